"""Any Hugging Face causal LM by path or hub id: the architecture read from its own config.json.

    python -m workbench model.path=/models/my-qwen2            # no catalog entry needed
    python -m workbench model.hub_id=mistralai/Mistral-7B-v0.3 dry_run=true

Catalog entries (`conf/model/*.yaml`) are named shortcuts that carry their architecture
numbers, so a 70B model can be planned on a laptop without its files. A model given by
`model.path`, or by a `model.hub_id` that is not the catalog entry's own, brings its numbers
with it: `adopt()` (called once by `workbench.resolve.validate`) reads its config.json, fills
`model.arch` from it, names the model after its directory or hub id and drops the catalog
entry's packaged GGUF, which belongs to a different model. `model.arch_from` records which
config.json was read; the planner then builds the real model class from it on the meta device,
so parameter counts are exact for any family transformers builds (Qwen2, Mistral, Gemma, Phi-3,
...), not just the ones `hf_config()` knows how to assemble from numbers.

Remote code stays off unless `model.trust_remote_code=true`. Nothing here loads weights; the
only network access is fetching one config.json from the hub, when the hub answers.
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path

from workbench.config.files import CONF_DIR, load_group_file
from workbench.core.errors import UserError
from workbench.models.local_path import weights_problem, where_problem


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers (never when HF_HUB_OFFLINE or WORKBENCH_OFFLINE is 1)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("WORKBENCH_OFFLINE") == "1":
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout):
            return True
    except OSError:
        return False


def _catalog(name: str):
    """conf/model/<name>.yaml, or None when `name` is not a catalog entry."""
    if not name or not (CONF_DIR / "model" / f"{name}.yaml").exists():
        return None
    return load_group_file("model", name)


def own_source(model_cfg) -> bool:
    """True when the weights are the user's own (a path, or a hub id the catalog entry does not name).
    model=tiny names no weights, so a path or hub id given with it (`debug=fast` picks tiny) is the
    user's explicit choice and wins: the smoke run trains that model."""
    if model_cfg.name == "tiny" and not (model_cfg.path or model_cfg.hub_id):
        return False
    if model_cfg.path:
        return True
    if not model_cfg.hub_id:
        return False
    entry = _catalog(model_cfg.name)
    return entry is None or entry.hub_id != model_cfg.hub_id


def config_file(model_cfg) -> Path:
    """The config.json of the model's own weights; UserError when it is not on this machine."""
    if model_cfg.path:
        problem = where_problem(model_cfg.path)  # a GGUF, a run dir, an adapter, nothing: what to pass instead
        if problem:
            raise UserError(problem)
        return (Path(model_cfg.path).expanduser() / "config.json").resolve()
    hub_id = model_cfg.hub_id
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(hub_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id or cache means "not cached"; the hub says why below
        hit = None
    if isinstance(hit, str) and Path(hit).exists():
        return Path(hit)
    if hub_reachable():
        try:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(hub_id, "config.json"))
        except Exception as exc:  # noqa: BLE001 - gated, missing and network errors come in many types
            raise UserError(f"model.hub_id={hub_id!r}: could not fetch its config.json "
                            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})") from None
    raise UserError(f"model.hub_id={hub_id!r}: its config.json is not in the Hugging Face cache and the hub is "
                    "not reachable from here; download the model and set model.path to its directory")


@functools.lru_cache(maxsize=16)
def _read(config_json: str, trust_remote_code: bool):
    from transformers import AutoConfig

    where = str(Path(config_json).parent)
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        text = str(exc)
        if "trust_remote_code" in text and not trust_remote_code:
            raise UserError(f"{config_json}: this model ships its own code; set model.trust_remote_code=true "
                            "if you trust it (it runs on this machine)") from None
        raise UserError(f"{config_json}: transformers cannot read this config ({text.splitlines()[0][:200]}); "
                        "a newer transformers may know this model type") from None
    except OSError as exc:
        raise UserError(f"{config_json}: not a readable model config ({str(exc).splitlines()[0][:200]})") from None


def read_config(model_cfg, config_json: str | Path | None = None):
    """The transformers config of the model's own weights (cached per process)."""
    f = str(config_json or model_cfg.arch_from or config_file(model_cfg))
    cfg = _read(f, bool(model_cfg.trust_remote_code))
    _check_causal(cfg, f)
    return cfg


def _check_causal(cfg, where: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(cfg) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    if "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {}):
        return  # remote code that declares a causal LM class
    archs = getattr(cfg, "architectures", None) or [cfg.model_type]
    raise UserError(f"{where}: model type {cfg.model_type!r} ({', '.join(archs)}) is not a causal language model "
                    "transformers can build with AutoModelForCausalLM; the workbench trains decoder-only LMs")


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def arch_numbers(hf_cfg) -> dict:
    """model.arch fields from a transformers config (the text part of a multimodal one)."""
    c = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
    heads = int(_first(c, "num_attention_heads", "n_head", default=1))
    hidden = int(_first(c, "hidden_size", "n_embd", "d_model"))
    rope = _first(c, "rope_parameters", "rope_scaling", default={}) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return {
        "family": str(c.model_type),
        "layers": int(_first(c, "num_hidden_layers", "n_layer")),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(_first(c, "num_key_value_heads", default=heads) or heads),
        "head_dim": _first(c, "head_dim"),
        "intermediate": int(_first(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden) or 4 * hidden),
        "vocab": int(c.vocab_size),
        # A model without a position limit (e.g. ALiBi) is not bounded by one.
        "max_position": int(_first(c, "max_position_embeddings", "n_positions", "seq_length", default=1 << 20)),
        "experts": int(_first(c, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0),
        "experts_per_token": int(_first(c, "num_experts_per_tok", "moe_topk", default=0) or 0),
        "tie_embeddings": bool(_first(hf_cfg, "tie_word_embeddings", default=False)),
        "rope_theta": float(theta if theta is not None else _first(c, "rope_theta", default=10000.0)),
        "rms_norm_eps": float(_first(c, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", default=1e-5)),
    }


def source_name(model_cfg) -> str:
    """A readable name for the user's model: its directory name or the last part of its hub id."""
    if model_cfg.path:
        return Path(model_cfg.path).expanduser().resolve().name or "model"
    return str(model_cfg.hub_id).rstrip("/").rsplit("/", 1)[-1]


def adopt(model_node) -> None:
    """Fill model.arch (and name, gguf_package, arch_from) from the model's own config.json.

    Called by workbench.resolve.validate on the merged config, before it is frozen; a no-op for
    catalog entries and the tiny model.
    """
    if model_node.name == "tiny" and model_node.gguf_package and not own_source(model_node):
        # a packaged GGUF is converted into the cache under its catalog entry's name: tiny has none
        raise UserError(f"model.gguf_package={model_node.gguf_package}: model=tiny (which debug=fast picks) has "
                        "random weights and converts no package; name the catalog entry that ships it "
                        "(e.g. model=smollm2-135m debug=fast), or give model.path")
    if not own_source(model_node):
        return
    f = config_file(model_node)
    hf_cfg = read_config(model_node, f)
    if model_node.path:  # the weights beside the config, whole: a dry run checks what the run would load
        problem = weights_problem(model_node.path)
        if problem:
            raise UserError(problem)
    entry = _catalog(model_node.name)
    if entry is not None:
        # The catalog entry the defaults picked describes another model: its name, packaged
        # GGUF (and, when a path is given, its hub id) must not leak into this run.
        model_node.name = source_name(model_node)
        model_node.gguf_package = None
        if model_node.tokenizer == entry.tokenizer:
            model_node.tokenizer = None  # a borrowed tokenizer (model=tiny) is not this model's
        if model_node.path and model_node.hub_id == entry.hub_id:
            model_node.hub_id = None
    for key, value in arch_numbers(hf_cfg).items():
        model_node.arch[key] = value
    model_node.arch_from = str(f)


def meta_model(model_cfg, layers: int | None = None):
    """The model's own class on the meta device (optionally with fewer blocks)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(read_config(model_cfg))
    if layers is not None:
        cfg.num_hidden_layers = layers
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=bool(model_cfg.trust_remote_code))
