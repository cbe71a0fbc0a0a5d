"""Compatibility rules: which combinations of method x peft x backend x precision x hardware
cannot work, and what to use instead.

Each rule (workbench/config/rule.py) is data (what it covers, for the docs) plus a predicate over
the validated config and the environment. The rules of one backend or one method alone are in its
spec (`SPEC.rules` in workbench/backends/<name>.py, workbench/methods/<name>.py); this module
holds the rules that cut across them, reading the specs' facts (whether a backend shards, loads
unsloth's model, which reference a method needs, whether it runs episodes), and puts the table
together: for a run, these plus its backend's and its method's rules; for the docs, every rule.
`check(cfg)` raises the first violation as a UserError whose message names the fix;
`scripts/gen_compat_docs.py` writes docs/compatibility.md from RULES, so the docs cannot drift
from what the code enforces.

    from workbench.resolve import rules
    rules.violations(cfg)          # all broken rules, as (rule, message)
    rules.check(cfg)               # raise the first one

This is the only place a combination is refused: `resolved.resolve_run(cfg)` runs it for every entry
point (preflight, the runner, export from a checkpoint), so backends, methods and loaders do not
check again. Fields owned by one backend or method (backend.stage, method.engine, ...) are read
by their schema names with a default, so a rule applies to any backend or method config.
"""

from __future__ import annotations

from workbench.backends import registry as backends
from workbench.config.rule import Env, Rule, backend_name, current_env, device, launcher_name, method_name, par, rewards
from workbench.config.schema import GGUF_TYPES, pick
from workbench.core.errors import UserError
from workbench.envs.rewards import NEEDS_ENV
from workbench.families import registry as families
from workbench.methods import registry
from workbench.resolve.derive import reference, sharded
from workbench.train.distributed import under_distributed_launcher
from workbench.train.layout import layout

RUNNABLE_DEVICES = ("cpu", "cuda")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "auto")
FLASH = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
KERNELS = ("none", "liger")
PLANNING = (True, "trace")  # dry_run values that plan without training (trace: workbench/plan/trace.py)


# -- readers of the chosen specs' facts --------------------------------------------------------
def _spec(c):
    return registry.spec(method_name(c))


def _facts(c):
    return _spec(c).facts


def _engine(c) -> str:
    """What generates the method's samples (hf | vllm; MethodSpec.generation), hf for one that does not."""
    gen = _spec(c).generation(c.get("method"))
    return gen.engine if gen else "hf"


def _backend_facts(c):
    return backends.spec(backend_name(c)).facts


def _unsloth_backends() -> str:
    return ", ".join(n for n, s in backends.SPECS.items() if s.facts.loads_unsloth)


def _episode_methods() -> str:
    return ", ".join(n for n, s in registry.SPECS.items() if s.facts.episodes)


def _storage_float(c) -> bool:
    return c.peft.quant_storage in ("bfloat16", "float16", "float32")


def _env(c):
    return pick(c, "env", None)


def _env_name(c):
    return pick(c, "env.name", "?")


def _episode_rewards(c) -> list[str]:
    """Reward functions that score a whole episode, for a method that runs episodes."""
    names = [f if isinstance(f, str) else f.get("name") for f in rewards(c)]
    return [n for n in names if n in NEEDS_ENV] if _facts(c).episodes else []


def _second_forward(c) -> str | None:
    """Why a method's loss would call the model twice per micro-batch, or None."""
    own = _spec(c).second_forward
    why = own(c.method) if own is not None else None
    if why:
        return why
    if reference(c) == "adapter":
        return f"method={method_name(c)}'s reference is the adapter-free model, a second forward"
    return None


# machine, precision, unsloth and peft: checked before the backend's own rules
FIRST: list[Rule] = [
    # precision x hardware
    Rule("fp8-needs-gpu", {"precision": "fp8", "hardware": "cpu"},
         lambda c, e: c.precision.name == "fp8" and device(c) != "cuda",
         "precision=fp8 needs a Hopper/Blackwell GPU; on CPU use precision=bf16-mixed"),
    Rule("fp8-needs-fp8-units", {"precision": "fp8", "hardware": "no fp8 units (e.g. tpu-v5p)"},
         lambda c, e: c.precision.name == "fp8" and device(c) == "cuda" and float(c.hardware.bf16_tflops) > 0
         and float(c.hardware.fp8_tflops) == 0,  # a catalog profile that lists no fp8 rate
         lambda c, e: f"precision=fp8: hardware={c.hardware.name} has no fp8 matmul units; use precision=bf16-mixed"),
    Rule("fp8-needs-torchao", {"precision": "fp8", "hardware": "cuda"},
         lambda c, e: c.precision.name == "fp8" and device(c) == "cuda" and e.cuda and not e.has("torchao")
         and not e.has("transformer_engine"),
         "precision=fp8 needs torchao (pip install torchao) or Transformer Engine; or use precision=bf16-mixed",
         machine=True),
    Rule("fp8-needs-sm89", {"precision": "fp8", "hardware": "GPU below compute capability 8.9"},
         lambda c, e: c.precision.name == "fp8" and device(c) == "cuda" and bool(e.capability)
         and tuple(e.capability) < (8, 9),
         lambda c, e: f"precision=fp8 needs fp8 tensor cores (compute capability >= 8.9, Hopper/Blackwell); this GPU "
                      f"has {tuple(e.capability)}: use precision=bf16-mixed", machine=True),
    # hardware
    Rule("cuda-not-visible", {"hardware": "cuda profile on a machine without GPU"},
         lambda c, e: device(c) == "cuda" and not e.cuda,
         # a dry run warns with it (it plans without a GPU): it is told what the run would need
         lambda c, e: f"hardware={c.hardware.name} wants CUDA but no GPU is visible; " + (
             "the plan is for that hardware, to train on this machine use hardware=cpu" if c.dry_run in PLANNING
             else "use hardware=cpu, or add dry_run=true to only plan"), machine=True),
    Rule("planning-only-accelerator", {"hardware": "gaudi3, trn2, tpu-v5p"},
         lambda c, e: device(c) not in RUNNABLE_DEVICES,
         lambda c, e: f"hardware={c.hardware.name} (device {c.hardware.device}) is a planning profile; the "
                      "backends run on cpu or cuda: " + (
                          "the plan is for it, to train use a cuda profile such as hardware=8xh100" if c.dry_run in PLANNING
                          else "add dry_run=true to plan, or use a cuda profile such as hardware=8xh100"),
         machine=True),
    Rule("procs-exceed-gpus", {"hardware": "procs > visible GPUs"},
         lambda c, e: device(c) == "cuda" and e.cuda and int(c.hardware.procs) > e.gpus,
         lambda c, e: f"hardware.procs={c.hardware.procs} but this node has {e.gpus} GPU(s); set hardware.procs<={e.gpus}",
         machine=True),
    Rule("multinode-needs-rendezvous", {"hardware": "nodes > 1"},
         # Slurm and Ray bring their own rendezvous (the job's first node, the Ray head), and a
         # process that is already a rank has been through one
         lambda c, e: int(c.hardware.nodes) > 1 and not c.hardware.rdzv_endpoint
         and launcher_name(c) == "local"
         and not under_distributed_launcher(),
         "hardware.nodes > 1 needs a rendezvous: set hardware.rdzv_endpoint=host:port (the same on every node)",
         machine=True),
    # unsloth
    Rule("unsloth-scalar-head", {"loader": "unsloth", "method": "rm"},
         lambda c, e: c.model.loader == "unsloth" and _facts(c).scalar_head,
         lambda c, e: f"method={method_name(c)} puts a scalar head on the model, which unsloth's loader does not build; "
                      "use model.loader=hf"),
    Rule("unsloth-needs-cuda", {"hardware": "cpu", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and device(c) != "cuda",
         "model.loader=unsloth needs a single CUDA GPU; on CPU use model.loader=hf", machine=True),
    Rule("unsloth-single-gpu", {"hardware": "more than 1 device", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and layout(c).world > 1,
         "model.loader=unsloth runs on one GPU only; use model.loader=hf with backend=fsdp2"),
    Rule("unsloth-backend", {"backend": "fsdp2, deepspeed, megatron", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and not _backend_facts(c).loads_unsloth,
         lambda c, e: f"model.loader=unsloth works with backend={_unsloth_backends()} only; use model.loader=hf for "
                      "sharded backends"),
    Rule("unsloth-kernels", {"loader": "unsloth", "kernels": "liger"},
         lambda c, e: c.model.loader == "unsloth" and c.kernels != "none",
         "model.loader=unsloth patches in its own kernels; use kernels=none with it"),
    Rule("unsloth-dora", {"loader": "unsloth", "peft": "dora"},
         lambda c, e: c.model.loader == "unsloth" and c.peft.kind == "dora",
         "model.loader=unsloth supports peft=lora, qlora or none; use model.loader=hf for dora"),
    Rule("unsloth-needs-package", {"loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and not e.has("unsloth"),
         "model.loader=unsloth needs unsloth: pip install -e '.[unsloth]' (or use model.loader=hf)", machine=True),
    # qlora
    Rule("qlora-sharded-storage", {"peft": "qlora", "backend": "fsdp2, deepspeed stage 3"},
         lambda c, e: c.peft.kind == "qlora" and sharded(c) and c.peft.quant_storage != "uint8" and not _storage_float(c),
         lambda c, e: f"peft=qlora under {backend_name(c)} shards the packed 4-bit weights, which needs a float storage "
                      f"dtype (uint8 is converted for you): set peft.quant_storage=bfloat16, not {c.peft.quant_storage}"),
    Rule("qlora-fp8", {"peft": "qlora", "precision": "fp8"},
         lambda c, e: c.peft.kind == "qlora" and c.precision.name == "fp8",
         "peft=qlora computes in bf16 over NF4 weights; fp8 does not apply: use precision=bf16-mixed"),
    Rule("qlora-needs-bitsandbytes", {"peft": "qlora"},
         lambda c, e: c.peft.kind == "qlora" and not e.has("bitsandbytes"),
         "peft=qlora needs bitsandbytes: pip install bitsandbytes (or use peft=lora)", machine=True),
]

def _sp(c) -> int:
    return par(c, "sp")


def _sp_methods() -> str:
    return ", ".join(n for n, s in registry.SPECS.items() if s.facts.splits_rows)


# a backend's facts against a method's: after the backend's rules, before the method's
COMBINED: list[Rule] = [
    # sequence parallelism (backend.sp on single, fsdp2, deepspeed: workbench/train/sequence_parallel.py)
    Rule("sp-divides-procs", {"backend": "single, fsdp2, deepspeed (sp > 1)"},
         lambda c, e: _sp(c) > 1 and layout(c).world % _sp(c) != 0,
         lambda c, e: f"backend.sp={_sp(c)} splits every row over {_sp(c)} ranks, which must divide the "
                      f"{layout(c).world} process(es): set hardware.procs to a multiple of {_sp(c)}"),
    Rule("sp-method", {"backend": "sp > 1", "method": "kto, rm, distill"},
         lambda c, e: _sp(c) > 1 and not _facts(c).splits_rows,
         lambda c, e: f"backend.sp={_sp(c)} cuts rows between ranks, and method={method_name(c)}'s loss reads whole "
                      f"rows; sequence parallelism trains method={_sp_methods()}: use backend.sp=1"),
    Rule("sp-heads", {"backend": "sp > 1", "model": "fewer attention heads than sp"},
         lambda c, e: _sp(c) > 1 and int(pick(c, "model.arch.heads", _sp(c))) < _sp(c),
         lambda c, e: f"backend.sp={_sp(c)} gives every rank whole attention heads and model={c.model.name} has "
                      f"{pick(c, 'model.arch.heads', '?')}: use backend.sp<={pick(c, 'model.arch.heads', '?')}"),
    Rule("sp-attention", {"backend": "sp > 1", "attention": "flash_attention_2, flash_attention_3"},
         lambda c, e: _sp(c) > 1 and c.model.attn_implementation not in ("sdpa", "eager", "auto"),
         lambda c, e: f"backend.sp={_sp(c)} runs its own attention over the whole row (PyTorch SDPA with the row's "
                      f"mask), so model.attn_implementation={c.model.attn_implementation} would not be used: set "
                      "model.attn_implementation=sdpa"),
    Rule("sharded-vllm", {"backend": "fsdp2, deepspeed stage 3", "method": "grpo (vLLM rollouts)"},
         lambda c, e: sharded(c) and _engine(c) == "vllm",
         "method.engine=vllm loads full weights into vLLM on every rank, which a sharding backend splits; use "
         "method.engine=hf (generates through the sharded model) or backend=deepspeed backend.stage=2"),
    Rule("sharded-copied-reference", {"backend": "fsdp2, deepspeed stage 3", "method": "dpo, kto / grpo with a copied reference"},
         lambda c, e: sharded(c) and reference(c) == "copy",
         lambda c, e: f"method={method_name(c)} keeps a copied reference model, which a sharding backend cannot shard; "
                      + ("use method.reference=precomputed, or peft=lora (its reference is the adapter-free base)"
                         if _facts(c).precomputed_reference
                         else "use peft=lora (its reference is the adapter-free base)" if _facts(c).reference == "method"
                         else "use peft=lora (its reference is the adapter-free base) or method.beta=0")),
    Rule("megatron-pp-one-forward", {"backend": "megatron (pp > 1)",
                                     "method": "kto (KL rows), reference=adapter (dpo, kto, grpo)"},
         lambda c, e: par(c, "pp") > 1 and _second_forward(c) is not None,
         lambda c, e: f"with backend.pp={par(c, 'pp')} the pipeline runs the model once per micro-batch, and "
                      f"{_second_forward(c)}; use backend.pp=1 (tp/ep split the model too)"),
    Rule("env-needs-grpo", {"method": "not grpo", "env": "any"},
         lambda c, e: _env(c) is not None and not _facts(c).episodes,
         lambda c, e: f"env={_env_name(c)} runs multi-turn episodes for method={_episode_methods()}; with "
                      f"method={method_name(c)} drop env (env=null), or use method={_episode_methods()}"),
    Rule("env-rewards-need-env", {"method": "grpo", "reward": "final_answer, env", "env": "none"},
         lambda c, e: _env(c) is None and bool(_episode_rewards(c)),
         lambda c, e: f"reward function(s) {_episode_rewards(c)} score whole episodes: choose an environment "
                      "(env=calc, or env.name=package.module:Class), or another reward"),
    Rule("dpo-adapter-ref-needs-peft", {"method": "dpo, kto (ref=adapter)", "peft": "none"},
         lambda c, e: _facts(c).reference == "method" and _spec(c).reference_choice(c.method) == "adapter"
         and c.peft.kind == "none",
         "method.reference=adapter uses the model with its adapter disabled as the reference, but peft=none has "
         "no adapter: use peft=lora, or method.reference=copy / method.reference=precomputed"),
]

# model x data x kernels, and export: last
LAST: list[Rule] = [
    Rule("seq-exceeds-context", {"data": "seq_len", "model": "max_position"},
         lambda c, e: c.data.seq_len > c.model.arch.max_position,
         lambda c, e: f"data.seq_len={c.data.seq_len} exceeds model={c.model.name}'s context of "
                      f"{c.model.arch.max_position}; set data.seq_len<={c.model.arch.max_position}"),
    Rule("attention-choice", {"model": "attn_implementation"},
         lambda c, e: c.model.attn_implementation not in ATTENTION,
         lambda c, e: f"model.attn_implementation={c.model.attn_implementation!r} is not one of {', '.join(ATTENTION)}"),
    Rule("flash-attn-on-cpu", {"hardware": "cpu", "attention": "flash_attention_2/3"},
         lambda c, e: c.model.attn_implementation in FLASH and device(c) != "cuda",
         "model.attn_implementation=flash_attention_* needs a CUDA GPU; use model.attn_implementation=sdpa",
         machine=True),
    Rule("flash-attn-needs-package", {"hardware": "cuda", "attention": "flash_attention_2/3"},
         lambda c, e: c.model.attn_implementation in FLASH and device(c) == "cuda"
         and not e.has(FLASH[c.model.attn_implementation]),
         "model.attn_implementation=flash_attention_* needs flash-attn: pip install flash-attn (or use sdpa)",
         machine=True),
    Rule("kernels-choice", {"kernels": "name"},
         lambda c, e: c.kernels not in KERNELS,
         lambda c, e: f"config field 'kernels' must be one of {', '.join(KERNELS)} (got {c.kernels!r})"),
    Rule("liger-on-cpu", {"hardware": "cpu", "kernels": "liger"},
         lambda c, e: c.kernels == "liger" and device(c) != "cuda",
         "kernels=liger are Triton GPU kernels; on CPU use kernels=none", machine=True),
    Rule("liger-needs-package", {"hardware": "cuda", "kernels": "liger"},
         lambda c, e: c.kernels == "liger" and device(c) == "cuda" and not e.has("liger_kernel"),
         "kernels=liger needs liger-kernel: pip install -e '.[liger]' (or use kernels=none)", machine=True),
    Rule("gguf-types", {"export": "gguf=<type>"},
         lambda c, e: c.train.export and any(str(t).lower() not in GGUF_TYPES for t in c.export.gguf),
         lambda c, e: f"export.gguf={list(c.export.gguf)}: choose from {list(GGUF_TYPES)}; K-quants "
                      "(q4_k_m, ...) need llama.cpp's llama-quantize on the f16 file"),
    Rule("gguf-family", {"export": "gguf", "model": "a family without a GGUF mapping"},
         lambda c, e: c.train.export and bool(c.export.gguf) and c.model.arch.family not in families.gguf_model_types(),
         lambda c, e: f"export.gguf: model family {c.model.arch.family!r} has no GGUF mapping here (supported: "
                      f"{families.gguf_model_types()}); drop export.gguf and convert the merged folder with llama.cpp"),
    Rule("push-needs-token", {"export": "push_to_hub"},
         lambda c, e: c.train.export and bool(c.export.push_to_hub) and not e.hub_token,
         "export.push_to_hub needs a write token in $HF_TOKEN (checked now, not after training)", machine=True),
]


def table(backend_rules, method_rules) -> list[Rule]:
    """The rules in the order a run reports them: a backend's parallel sizes before what they
    combine with, a method's options before the model and the export."""
    return [*FIRST, *backend_rules, *COMBINED, *method_rules, *LAST]


# every rule, for the docs (scripts/gen_compat_docs.py) and the tests
RULES: list[Rule] = table([r for s in backends.SPECS.values() for r in s.rules],
                          [r for s in registry.SPECS.values() for r in s.rules])


def violations(cfg, env: Env | None = None) -> list[tuple[Rule, str]]:
    """The broken rules of this run: the cross-cutting ones, its backend's and its method's."""
    env = env or current_env()
    backend = backends.spec(backend_name(cfg))
    method = registry.spec(method_name(cfg))
    own = [r for r in method.rules if r.backend_fact is None or getattr(backend.facts, r.backend_fact)]
    out = []
    for rule in table(backend.rules, own):
        if rule.broken(cfg, env):
            out.append((rule, rule.message(cfg, env)))
    return out


def runs_here(cfg) -> bool:
    """False when a launcher sends the run to other machines (their hardware is checked there)."""
    return pick(cfg, "launcher.name", "local") == "local"


def check(cfg, env: Env | None = None, planning: bool = False) -> list[str]:
    """Raise the first broken rule; rules about this machine only warn when planning
    (dry_run=true) or when a launcher runs the job elsewhere."""
    planning = planning or not runs_here(cfg)
    warnings = []
    for rule, msg in violations(cfg, env):
        if planning and rule.machine:
            warnings.append(f"[{rule.id}] {msg}")
            continue
        raise UserError(f"[{rule.id}] {msg}")
    return warnings
