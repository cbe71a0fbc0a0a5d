"""Validation of a composed config: the schemas applied, the method's and backend's options
checked against their registered dataclasses, and what a model or data given by path implies.

    from workbench.resolve.validate import validate
    cfg = validate(hydra_cfg)     # read-only DictConfig, or a UserError naming the first bad field

Hydra composes `conf/train.yaml` with its groups; `validate(cfg)` then merges the result onto
the dataclasses (workbench/config/schema.py), so an unknown key (`optim.lrr`) or a wrong type
(`optim.lr=abc`) fails with one line naming the field, before any model or data is touched.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from workbench.backends import registry as backends
from workbench.compute.optim import OPTIMIZERS, SCHEDULERS
from workbench.compute.precision import POLICIES
from workbench.config.schema import EvalConfig, Schema
from workbench.core.errors import UserError
from workbench.data.recipes import inline_recipe
from workbench.methods import registry as methods
from workbench.models.auto import adopt
from workbench.peft.kind import KINDS as PEFT_KINDS
from workbench.resolve import no_effect

PRECISIONS = ("auto", *POLICIES)  # auto: what the device does fastest (precision.choose)

# group name -> its registry: each choice's options dataclass is `registry.spec(name).config`
PLUGGABLE = {"method": methods, "backend": backends}


def _merge(schema_cls, node: DictConfig | None, where: str):
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema_cls), node or {})
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        path = f"{where}.{key}" if key and not key.startswith(where) else (key or where)
        msg = str(exc).splitlines()[0]
        raise UserError(f"config field '{path}': {msg}") from None
    return merged


def _own_model_and_data(merged: DictConfig, method_node: dict, env_node: dict | None = None) -> None:
    """Fill in what a model by path / hub id and data by path imply, before the config freezes:
    the architecture from the model's config.json (workbench/models/auto.py), the default
    evaluation on the data's held-out rows, and the inline recipe for data.path / data.eval_split
    (workbench/data/recipes.py)."""
    adopt(merged.model)
    spec = methods.spec(method_node.get("name"))
    own = method_node.get("recipe")
    if env_node and list(merged.eval.tasks) == EvalConfig().tasks:
        merged.eval.tasks = ["env"]  # an environment's episodes on its held-out rows (workbench/evals/episodes.py)
    elif merged.data.path is not None and list(merged.eval.tasks) == EvalConfig().tasks:
        # Your own data: the default evaluation is on its held-out rows, not the arithmetic task.
        merged.eval.tasks = [spec.facts.eval]
    elif list(merged.eval.tasks) == EvalConfig().tasks and spec.facts.embedded_eval:
        merged.eval.tasks = [spec.facts.embedded_eval]
    # data.recipe null: the method's own recipe (arith_sft, arith_dpo, arith_grpo); a data.eval_split
    # then splits that one.
    if env_node and env_node.get("recipe"):  # an environment's own prompt rows (conf/env/*.yaml recipe)
        own = env_node["recipe"]
    if own is None:
        own = spec.config().recipe
    if merged.data.recipe is None:
        merged.data.recipe = own
    inline = inline_recipe(merged.data, merged.eval.tasks)
    if inline is not None:
        merged.data.recipe = inline


def validate(cfg: DictConfig) -> DictConfig:
    """Return the config merged onto the schemas; raise UserError naming the first bad field."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(raw, dict):
        raise UserError("the composed config is not a mapping")
    plugin_nodes = {g: raw.pop(g, None) for g in PLUGGABLE}
    raw.pop("hydra", None)
    for group, node in plugin_nodes.items():
        if not node or "name" not in node:
            raise UserError(f"config group '{group}' has no 'name'; choose one, e.g. {group}=...")
    merged = _merge(Schema, OmegaConf.create(raw), "")
    no_effect.before_defaults(merged)  # data.recipe beside data.path, before the method's recipe fills it
    _own_model_and_data(merged, plugin_nodes["method"], raw.get("env"))
    for group, node in plugin_nodes.items():
        sub = _merge(PLUGGABLE[group].spec(node["name"]).config, OmegaConf.create(node), group)
        OmegaConf.set_struct(merged, False)
        merged[group] = sub
    OmegaConf.set_struct(merged, True)
    _check_values(merged)
    no_effect.check(merged)  # settings this run would not read (workbench/resolve/no_effect.py)
    _smoke_bounds(merged)
    # Every decision derived from here on lives in the resolved run (workbench/resolve/resolved.py);
    # nothing writes to the config after this point.
    OmegaConf.set_readonly(merged, True)
    return merged


def _smoke_bounds(cfg: DictConfig) -> None:
    """debug.max_new_tokens bounds generation whatever the method and environment options say:
    the chosen method's and env's token limits, the episode's turns, GRPO's refill rounds."""
    cap = cfg.debug.max_new_tokens
    if cap is None:
        return
    methods.spec(cfg.method.name).bound_generation(cfg.method, cap)
    env = cfg.get("env")
    if env is not None and "max_new_tokens" in env:
        env.max_new_tokens = min(int(env.max_new_tokens), int(cap))
    if env is not None and "max_turns" in env:
        env.max_turns = min(int(env.max_turns), 2)


# A learning rate above this is a typo (1e3 for 1e-3), not a setting: AdamW fine-tuning uses 1e-6
# to 1e-3, and the SGD runs of the tests 0.1 to 0.5.
MAX_LR = 1.0


def _betas_ok(betas) -> bool:
    return len(betas) == 2 and all(0 <= float(b) < 1 for b in betas)


def _check_values(cfg: DictConfig) -> None:
    """Range checks a type cannot express; each names the range, which is the fix."""
    checks = [
        ("optim.lr", cfg.optim.lr > 0, "must be > 0"),
        ("optim.lr", cfg.optim.lr <= MAX_LR,
         f"must be <= {MAX_LR:g}: a learning rate lies in (0, {MAX_LR:g}] (AdamW fine-tuning: 1e-6 to 1e-3; "
         "the default is 2e-4)"),
        ("optim.betas", _betas_ok(cfg.optim.betas), "must be two numbers in [0, 1), [beta1, beta2], e.g. [0.9, 0.999]"),
        ("optim.warmup_steps", cfg.optim.warmup_steps >= 0, "must be >= 0 (0: no warmup)"),
        ("eval.every_n_steps", cfg.eval.every_n_steps >= 0, "must be >= 0 (0: only before and after training)"),
        ("train.log_every", cfg.train.log_every >= 1, "must be >= 1 (a progress line every N steps)"),
        ("hardware.threads", cfg.hardware.threads >= 0, "must be >= 0 (0: leave torch's thread count as it is)"),
        ("peft.dropout", 0 <= cfg.peft.dropout < 1, "must be in [0, 1) (0: no dropout)"),
        ("optim.max_grad_norm", cfg.optim.max_grad_norm >= 0, "must be >= 0"),
        ("train.max_steps", cfg.train.max_steps >= 0, "must be >= 0"),
        ("train.micro_batch_size", cfg.train.micro_batch_size >= 1, "must be >= 1"),
        ("train.grad_accum", cfg.train.grad_accum >= 1, "must be >= 1"),
        ("data.seq_len", cfg.data.seq_len >= 8, "must be >= 8"),
        ("peft.r", cfg.peft.r >= 1, "must be >= 1"),
        ("hardware.procs", cfg.hardware.procs >= 1, "must be >= 1"),
        ("peft.kind", cfg.peft.kind in PEFT_KINDS, f"must be one of {', '.join(PEFT_KINDS)}"),
        ("precision.name", cfg.precision.name in PRECISIONS, f"must be one of {', '.join(PRECISIONS)}"),
        ("optim.name", cfg.optim.name in OPTIMIZERS, f"must be one of {', '.join(OPTIMIZERS)}"),
        ("optim.scheduler", cfg.optim.scheduler in SCHEDULERS, f"must be one of {', '.join(SCHEDULERS)}"),
        ("data.on_bad_row", cfg.data.on_bad_row in ("error", "skip"), "must be error or skip"),
        ("data.pack_len", cfg.data.pack_len == 0 or cfg.data.pack_len >= cfg.data.seq_len, "must be 0 or >= data.seq_len"),
        ("model.loader", cfg.model.loader in ("hf", "unsloth"), "must be hf or unsloth"),
        ("train.resume_check", cfg.train.resume_check in ("error", "warn"), "must be error or warn"),
        ("train.resume_changes", cfg.train.resume_changes in ("refuse", "allow"), "must be refuse or allow"),
        ("dry_run", cfg.dry_run in (False, True, "trace"), "must be true, false or trace"),
    ]
    for name, ok, why in checks:
        if not ok:
            raise UserError(f"config field '{name}' {why} (got {OmegaConf.select(cfg, name)!r})")
