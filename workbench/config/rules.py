"""Compatibility rules: which combinations of method x peft x backend x precision x hardware
cannot work, and what to use instead.

Each rule is data (what it covers, for the docs) plus a predicate over the validated config and
the environment. `check(cfg)` raises the first violation as a UserError whose message names the
fix; `scripts/gen_compat_docs.py` writes docs/compatibility.md from the same table, so the docs
cannot drift from what the code enforces.

    from workbench.config import rules
    rules.violations(cfg)          # all broken rules, as (rule, message)
    rules.check(cfg)               # raise the first one

This is the only place a combination is refused: `resolved.resolve(cfg)` runs it for every entry
point (preflight, the runner, export from a checkpoint), so backends, methods and loaders do not
check again. Fields owned by one backend or method (backend.stage, method.engine, ...) are read
by their schema names with a default, so a rule applies to any backend or method config.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.config.schema import pick
from workbench.core.errors import UserError
from workbench.methods import registry

RUNNABLE_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Env:
    """What the machine offers; tests pass their own."""

    cuda: bool = False
    gpus: int = 0
    packages: frozenset = frozenset()
    hub_token: bool = False  # $HF_TOKEN is set (its value is never read here)
    capability: tuple = ()  # CUDA compute capability of device 0; () not known

    def has(self, package: str) -> bool:
        return package in self.packages


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ValueError, ImportError):  # a module blocked in sys.modules, or a broken parent
        return False


def current_env() -> Env:
    import torch

    cuda = torch.cuda.is_available()
    names = ("bitsandbytes", "deepspeed", "megatron", "unsloth", "vllm", "liger_kernel", "torchao",
             "transformer_engine", "apex", "flash_attn", "flash_attn_interface")
    found = frozenset(n for n in names if _installed(n))
    token = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    return Env(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0, packages=found, hub_token=token,
               capability=tuple(torch.cuda.get_device_capability()) if cuda else ())


@dataclass(frozen=True)
class Rule:
    id: str
    covers: dict[str, str]  # axis -> value(s) the rule is about, for the docs table
    broken: Callable  # (cfg, env) -> bool
    fix: Callable | str  # message naming the fix; callable gets (cfg, env)
    why: str = ""
    tags: tuple = field(default=())

    def message(self, cfg, env) -> str:
        return self.fix(cfg, env) if callable(self.fix) else self.fix


# -- helpers that read fields other modules own -------------------------------------------------
def _dev(c):
    return c.hardware.device


def _world(c):
    """Processes of the run: the launcher's WORLD_SIZE inside a launched process (the user's own
    torchrun too), else hardware.procs x hardware.nodes (workbench/config/resolved.py, layout)."""
    from workbench.config.run import layout

    return layout(c).world


def _dp(c):
    """Data-parallel ranks: the layout's world divided by tp x pp x cp, as the run will have it."""
    from workbench.config.run import layout

    return layout(c).dp


def _backend(c):
    return pick(c, "backend.name", "single")


def _method(c):
    return pick(c, "method.name", "sft")


def _facts(c):
    return registry.spec(_method(c)).facts


def _stage(c):
    return int(pick(c, "backend.stage", 0))


def _sharded(c):
    from workbench.config.run import sharded

    return sharded(c)


def _storage_float(c):
    return c.peft.quant_storage in ("bfloat16", "float16", "float32")


def _par(c, key):
    return int(pick(c, f"backend.{key}", 1))


def _rewards(c):
    return list(pick(c, "reward.functions", []) or [])


def _offload(c, key):
    return pick(c, f"backend.{key}", "none") != "none"


def _use_vllm(c):
    return _method(c) == "grpo" and pick(c, "method.engine", "hf") == "vllm"


def _grpo_args(c):
    """GRPO's batch settings (method.num_generations, prompts_per_step, train.micro_batch_size,
    grad_accum) and the run's data-parallel ranks, as methods/grpo.py make_shape takes them."""
    from workbench.methods.grpo import Config

    return (int(pick(c, "method.num_generations", Config.num_generations)),
            pick(c, "method.prompts_per_step", None), int(c.train.micro_batch_size), int(c.train.grad_accum), _dp(c))


def _grpo_shape(c):
    """Why GRPO's batch does not divide into whole groups per data-parallel rank, or None."""
    from workbench.methods.grpo import shape_problem

    if _method(c) != "grpo" or int(pick(c, "method.num_generations", 2)) < 2:
        return None  # not GRPO, or grpo-group-size says what is wrong
    return shape_problem(*_grpo_args(c))


def _grpo_accum(c):
    """The micro-batches per rank GRPO's method.prompts_per_step makes (train.grad_accum without it)."""
    from workbench.methods.grpo import make_shape

    return make_shape(*_grpo_args(c)).grad_accum


def _env(c):
    return pick(c, "env", None)


def _env_name(c):
    return pick(c, "env.name", "?")


def _episode_rewards(c):
    from workbench.envs.rewards import NEEDS_ENV

    names = [f if isinstance(f, str) else f.get("name") for f in _rewards(c)]
    return [n for n in names if n in NEEDS_ENV] if _method(c) == "grpo" else []


def _async(c):
    return _method(c) == "grpo" and bool(pick(c, "method.async_rollouts", False))


def _ref(c):
    from workbench.config.run import reference

    return reference(c)


ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "auto")
FLASH = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
KERNELS = ("none", "liger")


RULES: list[Rule] = [
    # precision x hardware
    Rule("fp8-needs-gpu", {"precision": "fp8", "hardware": "cpu"},
         lambda c, e: c.precision.name == "fp8" and _dev(c) != "cuda",
         "precision=fp8 needs a Hopper/Blackwell GPU; on CPU use precision=bf16-mixed"),
    Rule("fp8-needs-fp8-units", {"precision": "fp8", "hardware": "no fp8 units (e.g. tpu-v5p)"},
         lambda c, e: c.precision.name == "fp8" and _dev(c) == "cuda" and float(c.hardware.bf16_tflops) > 0
         and float(c.hardware.fp8_tflops) == 0,  # a catalog profile that lists no fp8 rate
         lambda c, e: f"precision=fp8: hardware={c.hardware.name} has no fp8 matmul units; use precision=bf16-mixed"),
    Rule("fp8-needs-torchao", {"precision": "fp8", "hardware": "cuda"},
         lambda c, e: c.precision.name == "fp8" and _dev(c) == "cuda" and e.cuda and not e.has("torchao")
         and not e.has("transformer_engine"),
         "precision=fp8 needs torchao (pip install torchao) or Transformer Engine; or use precision=bf16-mixed"),
    Rule("fp8-needs-sm89", {"precision": "fp8", "hardware": "GPU below compute capability 8.9"},
         lambda c, e: c.precision.name == "fp8" and _dev(c) == "cuda" and bool(e.capability)
         and tuple(e.capability) < (8, 9),
         lambda c, e: f"precision=fp8 needs fp8 tensor cores (compute capability >= 8.9, Hopper/Blackwell); this GPU "
                      f"has {tuple(e.capability)}: use precision=bf16-mixed"),
    # hardware
    Rule("cuda-not-visible", {"hardware": "cuda profile on a machine without GPU"},
         lambda c, e: _dev(c) == "cuda" and not e.cuda,
         lambda c, e: f"hardware={c.hardware.name} wants CUDA but no GPU is visible; use hardware=cpu, "
                      f"or add dry_run=true to only plan"),
    Rule("planning-only-accelerator", {"hardware": "gaudi3, trn2, tpu-v5p"},
         lambda c, e: _dev(c) not in RUNNABLE_DEVICES,
         lambda c, e: f"hardware={c.hardware.name} (device {c.hardware.device}) is a planning profile; the "
                      f"backends run on cpu or cuda: add dry_run=true to plan, or use a cuda profile such as hardware=8xh100"),
    Rule("procs-exceed-gpus", {"hardware": "procs > visible GPUs"},
         lambda c, e: _dev(c) == "cuda" and e.cuda and int(c.hardware.procs) > e.gpus,
         lambda c, e: f"hardware.procs={c.hardware.procs} but this node has {e.gpus} GPU(s); set hardware.procs<={e.gpus}"),
    Rule("multinode-needs-rendezvous", {"hardware": "nodes > 1"},
         lambda c, e: int(c.hardware.nodes) > 1 and not c.hardware.rdzv_endpoint,
         "hardware.nodes > 1 needs a rendezvous: set hardware.rdzv_endpoint=host:port (the same on every node)"),
    # unsloth
    Rule("unsloth-scalar-head", {"loader": "unsloth", "method": "rm"},
         lambda c, e: c.model.loader == "unsloth" and _facts(c).scalar_head,
         lambda c, e: f"method={_method(c)} puts a scalar head on the model, which unsloth's loader does not build; "
                      "use model.loader=hf"),
    Rule("unsloth-needs-cuda", {"hardware": "cpu", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and _dev(c) != "cuda",
         "model.loader=unsloth needs a single CUDA GPU; on CPU use model.loader=hf"),
    Rule("unsloth-single-gpu", {"hardware": "more than 1 device", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and _world(c) > 1,
         "model.loader=unsloth runs on one GPU only; use model.loader=hf with backend=fsdp2"),
    Rule("unsloth-backend", {"backend": "fsdp2, deepspeed, megatron", "loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and _backend(c) != "single",
         "model.loader=unsloth works with backend=single only; use model.loader=hf for sharded backends"),
    Rule("unsloth-kernels", {"loader": "unsloth", "kernels": "liger"},
         lambda c, e: c.model.loader == "unsloth" and c.kernels != "none",
         "model.loader=unsloth patches in its own kernels; use kernels=none with it"),
    Rule("unsloth-dora", {"loader": "unsloth", "peft": "dora"},
         lambda c, e: c.model.loader == "unsloth" and c.peft.kind == "dora",
         "model.loader=unsloth supports peft=lora, qlora or none; use model.loader=hf for dora"),
    Rule("unsloth-needs-package", {"loader": "unsloth"},
         lambda c, e: c.model.loader == "unsloth" and not e.has("unsloth"),
         "model.loader=unsloth needs unsloth: pip install -e '.[unsloth]' (or use model.loader=hf)"),
    # qlora
    Rule("qlora-sharded-storage", {"peft": "qlora", "backend": "fsdp2, deepspeed stage 3"},
         lambda c, e: c.peft.kind == "qlora" and _sharded(c) and c.peft.quant_storage != "uint8" and not _storage_float(c),
         lambda c, e: f"peft=qlora under {_backend(c)} shards the packed 4-bit weights, which needs a float storage "
                      f"dtype (uint8 is converted for you): set peft.quant_storage=bfloat16, not {c.peft.quant_storage}"),
    Rule("qlora-zero3-checkpointing", {"peft": "qlora", "backend": "deepspeed stage 3", "other": "gradient checkpointing"},
         lambda c, e: c.peft.kind == "qlora" and _backend(c) == "deepspeed" and _stage(c) == 3
         and c.model.gradient_checkpointing,
         "peft=qlora with ZeRO-3 and model.gradient_checkpointing is not supported; use backend=fsdp2 with "
         "backend.activation_checkpointing=full"),
    Rule("qlora-megatron", {"peft": "qlora", "backend": "megatron"},
         lambda c, e: c.peft.kind == "qlora" and _backend(c) == "megatron",
         "peft=qlora is not supported on backend=megatron (no 4-bit Megatron layers); use peft=lora there, "
         "or peft=qlora with backend=fsdp2"),
    Rule("qlora-fp8", {"peft": "qlora", "precision": "fp8"},
         lambda c, e: c.peft.kind == "qlora" and c.precision.name == "fp8",
         "peft=qlora computes in bf16 over NF4 weights; fp8 does not apply: use precision=bf16-mixed"),
    Rule("qlora-needs-bitsandbytes", {"peft": "qlora"},
         lambda c, e: c.peft.kind == "qlora" and not e.has("bitsandbytes"),
         "peft=qlora needs bitsandbytes: pip install bitsandbytes (or use peft=lora)"),
    Rule("dora-megatron", {"peft": "dora", "backend": "megatron"},
         lambda c, e: c.peft.kind == "dora" and _backend(c) == "megatron",
         "peft=dora is not built for backend=megatron (a row-parallel layer's weight norms would need a TP "
         "all-reduce per step); use peft=lora there, or peft=dora with backend=fsdp2"),
    # backends
    Rule("deepspeed-fp8", {"backend": "deepspeed", "precision": "fp8"},
         lambda c, e: _backend(c) == "deepspeed" and c.precision.name == "fp8",
         "precision=fp8 is not supported with backend=deepspeed; use precision=bf16-mixed, or backend=fsdp2 for fp8"),
    Rule("fsdp2-model-checkpointing", {"backend": "fsdp2", "other": "model.gradient_checkpointing"},
         lambda c, e: _backend(c) == "fsdp2" and c.model.gradient_checkpointing,
         "under backend=fsdp2 use backend.activation_checkpointing=full instead of model.gradient_checkpointing=true"),
    Rule("deepspeed-stage", {"backend": "deepspeed"},
         lambda c, e: _backend(c) == "deepspeed" and _stage(c) not in (1, 2, 3),
         lambda c, e: f"backend.stage={_stage(c)}: ZeRO stages are 1, 2 or 3; for plain data parallelism "
                      f"use backend=single"),
    Rule("deepspeed-offload-choice", {"backend": "deepspeed", "offload": "optimizer, params"},
         lambda c, e: _backend(c) == "deepspeed" and any(pick(c, f"backend.{k}", "none") not in ("none", "cpu", "nvme")
                                                      for k in ("offload_optimizer", "offload_param")),
         lambda c, e: f"config fields 'backend.offload_optimizer' / 'backend.offload_param' must be none, cpu or nvme "
                      f"(got {pick(c, 'backend.offload_optimizer', 'none')!r} / {pick(c, 'backend.offload_param', 'none')!r})"),
    Rule("param-offload-needs-zero3", {"backend": "deepspeed stage < 3", "offload": "params"},
         lambda c, e: _backend(c) == "deepspeed" and _offload(c, "offload_param") and _stage(c) != 3,
         "backend.offload_param needs parameters partitioned: set backend.stage=3 (stages 1-2 keep full "
         "parameters on every rank)"),
    Rule("nvme-offload-needs-path", {"backend": "deepspeed", "offload": "nvme"},
         lambda c, e: _backend(c) == "deepspeed" and "nvme" in (pick(c, "backend.offload_optimizer", "none"),
                                                                 pick(c, "backend.offload_param", "none"))
         and not os.path.isdir(str(pick(c, "backend.nvme_path", "") or "")),
         lambda c, e: "backend.offload_*=nvme needs an existing directory on local NVMe: set backend.nvme_path "
                      f"(got {pick(c, 'backend.nvme_path', '')!r})"),
    Rule("fsdp2-checkpointing-choice", {"backend": "fsdp2", "other": "activation checkpointing"},
         lambda c, e: _backend(c) == "fsdp2" and (pick(c, "backend.activation_checkpointing", "none")
                                                  not in ("none", "full", "selective")
                                                  or int(pick(c, "backend.selective_every", 2)) < 1),
         lambda c, e: "config field 'backend.activation_checkpointing' must be none, full or selective, and "
                      f"'backend.selective_every' >= 1 (got {pick(c, 'backend.activation_checkpointing', 'none')!r}, "
                      f"{pick(c, 'backend.selective_every', 2)})"),
    Rule("fsdp2-reduce-dtype", {"backend": "fsdp2", "precision": "reduce dtype"},
         lambda c, e: _backend(c) == "fsdp2" and pick(c, "backend.reduce_dtype", "float32")
         not in ("float32", "bfloat16", "float16"),
         lambda c, e: f"config field 'backend.reduce_dtype' must be float32, bfloat16 or float16 "
                      f"(got {pick(c, 'backend.reduce_dtype', 'float32')!r})"),
    Rule("sharded-vllm", {"backend": "fsdp2, deepspeed stage 3", "method": "grpo (vLLM rollouts)"},
         lambda c, e: _sharded(c) and _use_vllm(c),
         "method.engine=vllm loads full weights into vLLM on every rank, which a sharding backend splits; use "
         "method.engine=hf (generates through the sharded model) or backend=deepspeed backend.stage=2"),
    Rule("sharded-copied-reference", {"backend": "fsdp2, deepspeed stage 3", "method": "dpo, kto / grpo with a copied reference"},
         lambda c, e: _sharded(c) and _ref(c) == "copy",
         lambda c, e: f"method={_method(c)} keeps a copied reference model, which a sharding backend cannot shard; "
                      + ("use method.reference=precomputed, or peft=lora (its reference is the adapter-free base)"
                         if _facts(c).reference == "method" and _method(c) != "kto"
                         else "use peft=lora (its reference is the adapter-free base)" if _method(c) == "kto"
                         else "use peft=lora (its reference is the adapter-free base) or method.beta=0")),
    Rule("fsdp2-offload-on-cpu", {"backend": "fsdp2", "offload": "cpu_offload", "hardware": "cpu"},
         lambda c, e: _backend(c) == "fsdp2" and bool(pick(c, "backend.cpu_offload", False)) and _dev(c) == "cpu",
         "backend.cpu_offload moves GPU memory to the host; on hardware=cpu set backend.cpu_offload=false"),
    Rule("deepspeed-needs-package", {"backend": "deepspeed"},
         lambda c, e: _backend(c) == "deepspeed" and not e.has("deepspeed"),
         "backend=deepspeed needs deepspeed: pip install -e '.[deepspeed]' (or use backend=fsdp2)"),
    Rule("megatron-needs-package", {"backend": "megatron"},
         lambda c, e: _backend(c) == "megatron" and not e.has("megatron"),
         "backend=megatron needs megatron-core: pip install -e '.[megatron]' (or use backend=fsdp2)"),
    Rule("tp-divides-heads", {"backend": "megatron (tp)"},
         lambda c, e: _par(c, "tp") > 1 and (c.model.arch.heads % _par(c, "tp") or c.model.arch.kv_heads % _par(c, "tp")),
         lambda c, e: f"backend.tp={_par(c, 'tp')} must divide the attention heads ({c.model.arch.heads}) and KV "
                      f"heads ({c.model.arch.kv_heads}) of model={c.model.name}; choose a divisor of "
                      f"{c.model.arch.kv_heads}"),
    Rule("pp-divides-layers", {"backend": "megatron (pp)"},
         lambda c, e: _par(c, "pp") > 1 and c.model.arch.layers % _par(c, "pp"),
         lambda c, e: f"backend.pp={_par(c, 'pp')} must divide the {c.model.arch.layers} layers of "
                      f"model={c.model.name}; choose a divisor of {c.model.arch.layers}"),
    Rule("parallel-divides-world", {"backend": "megatron (tp x pp x cp)", "hardware": "devices"},
         lambda c, e: _world(c) % (_par(c, "tp") * _par(c, "pp") * _par(c, "cp")) != 0,
         lambda c, e: f"backend.tp x pp x cp = {_par(c, 'tp') * _par(c, 'pp') * _par(c, 'cp')} must divide the "
                      f"{_world(c)} devices (hardware.procs x hardware.nodes); change the parallel sizes or the devices"),
    Rule("ep-needs-experts", {"backend": "megatron (ep)", "model": "dense or experts not divisible"},
         lambda c, e: _par(c, "ep") > 1 and (not c.model.arch.experts or c.model.arch.experts % _par(c, "ep")),
         lambda c, e: f"backend.ep={_par(c, 'ep')} needs a MoE model whose experts ({c.model.arch.experts}) it "
                      f"divides; use backend.ep=1 for model={c.model.name}"),
    Rule("cp-divides-seq", {"backend": "megatron (cp)", "data": "seq_len"},
         lambda c, e: _par(c, "cp") > 1 and c.data.seq_len % (2 * _par(c, "cp")),
         lambda c, e: f"backend.cp={_par(c, 'cp')} splits each sequence in 2 x cp chunks: make data.seq_len a "
                      f"multiple of {2 * _par(c, 'cp')}"),
    Rule("megatron-fp8", {"backend": "megatron", "precision": "backend.fp8"},
         lambda c, e: _backend(c) == "megatron" and pick(c, "backend.fp8", None) is not None,
         "backend.fp8 needs Transformer Engine layer specs, which backend=megatron does not build yet: set backend.fp8=null"),
    Rule("megatron-distopt-fp16", {"backend": "megatron (distributed optimizer)", "precision": "fp16"},
         lambda c, e: _backend(c) == "megatron" and bool(pick(c, "backend.distributed_optimizer", False))
         and c.precision.name == "fp16",
         "backend.distributed_optimizer=true keeps fp16 weights only with Megatron's loss scaler, which the "
         "backend's schedule does not apply: use precision=bf16-mixed (or fp32)"),
    Rule("megatron-distopt-adam", {"backend": "megatron (distributed optimizer)", "other": "optim.name=sgd"},
         lambda c, e: _backend(c) == "megatron" and bool(pick(c, "backend.distributed_optimizer", False))
         and c.optim.name != "adamw",
         lambda c, e: f"backend.distributed_optimizer=true shards Adam's state; Megatron-Core 0.16's distributed "
                      f"optimizer steps Adam only (distrib_optimizer.py:516): use optim.name=adamw, or "
                      f"backend.distributed_optimizer=false for optim.name={c.optim.name}"),
    Rule("megatron-moe-tp-needs-sp", {"backend": "megatron (tp > 1)", "model": "mixture of experts"},
         lambda c, e: _backend(c) == "megatron" and bool(c.model.arch.experts) and _par(c, "tp") > 1
         and not bool(pick(c, "backend.sequence_parallel", False)),
         lambda c, e: f"model={c.model.name} has experts: Megatron-Core's MoE layer refuses to train with "
                      f"backend.tp={_par(c, 'tp')} and no sequence parallelism (without it every TP rank routes "
                      "the same tokens and expert gradients come out tp times too large): set "
                      "backend.sequence_parallel=true (GPU, Transformer Engine or Apex), or backend.tp=1 with "
                      "backend.ep for the experts"),
    Rule("megatron-pp-one-forward", {"backend": "megatron (pp > 1)",
                                     "method": "kto (KL rows), reference=adapter (dpo, kto, grpo)"},
         lambda c, e: _backend(c) == "megatron" and _par(c, "pp") > 1 and _second_forward(c) is not None,
         lambda c, e: f"with backend.pp={_par(c, 'pp')} the pipeline runs the model once per micro-batch, and "
                      f"{_second_forward(c)}; use backend.pp=1 (tp/ep split the model too)"),
    Rule("megatron-sequence-parallel", {"backend": "megatron (sp)"},
         lambda c, e: _backend(c) == "megatron" and bool(pick(c, "backend.sequence_parallel", False))
         and (_par(c, "tp") < 2 or not (e.has("transformer_engine") or e.has("apex"))),
         "backend.sequence_parallel=true needs backend.tp > 1 and Transformer Engine or Apex norms (GPU)"),
    Rule("megatron-cp-needs-gpu", {"backend": "megatron (cp)", "hardware": "cpu"},
         lambda c, e: _backend(c) == "megatron" and _par(c, "cp") > 1 and _dev(c) != "cuda",
         "backend.cp > 1 needs Transformer Engine's attention on a GPU"),
    Rule("megatron-recompute-choice", {"backend": "megatron"},
         lambda c, e: _backend(c) == "megatron" and pick(c, "backend.recompute", "none") not in ("none", "selective", "full"),
         lambda c, e: f"backend.recompute={pick(c, 'backend.recompute', 'none')!r} is not one of none, selective, full"),
    # methods
    Rule("grpo-needs-reward", {"method": "grpo"},
         lambda c, e: _method(c) == "grpo" and not _rewards(c),
         "method=grpo needs at least one reward: add reward=arith_exact (or reward.functions=[{name: module:function}])"),
    Rule("grpo-group-size", {"method": "grpo"},
         lambda c, e: _method(c) == "grpo" and int(pick(c, "method.num_generations", 2)) < 2,
         "method=grpo compares completions within a group: set method.num_generations>=2"),
    Rule("grpo-whole-groups", {"method": "grpo", "hardware": "data-parallel ranks",
                               "other": "train.micro_batch_size x grad_accum, method.prompts_per_step"},
         lambda c, e: _grpo_shape(c) is not None,
         lambda c, e: _grpo_shape(c)),
    Rule("grpo-deepspeed-accum", {"method": "grpo (prompts_per_step)", "backend": "deepspeed",
                                  "other": "train.grad_accum"},
         lambda c, e: _backend(c) == "deepspeed" and _method(c) == "grpo" and _grpo_shape(c) is None
         and pick(c, "method.prompts_per_step", None) is not None and _grpo_accum(c) != c.train.grad_accum,
         # DeepSpeed counts accumulation boundaries from its own config, which train.grad_accum sets
         lambda c, e: f"method.prompts_per_step={pick(c, 'method.prompts_per_step', None)} makes {_grpo_accum(c)} "
                      f"micro-batches per step; with backend=deepspeed set train.grad_accum={_grpo_accum(c)} to match"),
    Rule("env-needs-grpo", {"method": "not grpo", "env": "any"},
         lambda c, e: _env(c) is not None and _method(c) != "grpo",
         lambda c, e: f"env={_env_name(c)} runs multi-turn episodes for method=grpo; with method={_method(c)} drop env "
                      "(env=null), or use method=grpo"),
    Rule("env-rewards-need-env", {"method": "grpo", "reward": "final_answer, env", "env": "none"},
         lambda c, e: _env(c) is None and bool(_episode_rewards(c)),
         lambda c, e: f"reward function(s) {_episode_rewards(c)} score whole episodes: choose an environment "
                      "(env=calc, or env.name=package.module:Class), or another reward"),
    Rule("async-rollouts-one-process", {"method": "grpo (async_rollouts)", "hardware": "more than 1 process"},
         lambda c, e: _async(c) and _world(c) > 1,
         "method.async_rollouts=true generates in a second thread with a copy of the weights in one process; with "
         "several ranks (DDP, FSDP2, ZeRO) generation is a collective the training thread's collectives would "
         "interleave with: use method.async_rollouts=false there"),
    Rule("async-rollouts-vllm", {"method": "grpo (async_rollouts, vLLM rollouts)"},
         lambda c, e: _async(c) and _use_vllm(c),
         "method.async_rollouts=true overlaps HF generation with training; with method.engine=vllm use "
         "method.async_rollouts=false"),
    Rule("async-rollouts-kl-in-reward", {"method": "grpo (async_rollouts, kl_in_reward)"},
         lambda c, e: _async(c) and bool(pick(c, "method.kl_in_reward", False)) and float(pick(c, "method.beta", 0)) > 0,
         "method.kl_in_reward=true reads the reference off the live model while the rollout runs ahead in its own "
         "thread; use method.async_rollouts=false, or the KL in the loss (method.kl_in_reward=false)"),
    Rule("kto-kl-needs-pairs", {"method": "kto (loss_type=kto)", "other": "train.micro_batch_size=1"},
         lambda c, e: _method(c) == "kto" and pick(c, "method.loss_type", "kto") == "kto"
         and c.train.micro_batch_size < 2,
         lambda c, e: "method=kto estimates its KL reference point from pairs within a micro-batch: set "
                      f"train.micro_batch_size >= 2 (got {c.train.micro_batch_size}), or "
                      "method.loss_type=apo_zero_unpaired, which has none"),
    Rule("vllm-needs-cuda", {"method": "grpo (vLLM rollouts)", "hardware": "cpu"},
         lambda c, e: _use_vllm(c) and _dev(c) != "cuda",
         "method.engine=vllm needs a CUDA GPU; on CPU use method.engine=hf (generate with KV cache)"),
    Rule("vllm-needs-package", {"method": "grpo (vLLM rollouts)"},
         lambda c, e: _use_vllm(c) and not e.has("vllm"),
         "method.engine=vllm needs vllm: pip install -e '.[vllm]' (or use method.engine=hf)"),
    Rule("vllm-dora", {"method": "grpo (vLLM rollouts)", "peft": "dora"},
         lambda c, e: _use_vllm(c) and c.peft.kind == "dora",
         "method.engine=vllm syncs lora, qlora or full weights; use method.engine=hf with peft=dora"),
    Rule("dpo-adapter-ref-needs-peft", {"method": "dpo, kto (ref=adapter)", "peft": "none"},
         lambda c, e: _facts(c).reference == "method" and pick(c, "method.reference", None) == "adapter"
         and c.peft.kind == "none",
         "method.reference=adapter uses the model with its adapter disabled as the reference, but peft=none has "
         "no adapter: use peft=lora, or method.reference=copy / method.reference=precomputed"),
    Rule("distill-needs-teacher", {"method": "distill"},
         lambda c, e: _method(c) == "distill" and not pick(c, "method.teacher", None),
         "method=distill needs method.teacher: set it to a model dir, run dir, conf/model name or hub id "
         "(with model='s tokenizer)"),
    Rule("distill-packing", {"method": "distill", "data": "packing"},
         lambda c, e: _method(c) == "distill" and bool(pick(c, "data.packing", False)),
         "method=distill compares the teacher's and the student's next-token distributions row by row: set "
         "data.packing=false"),
    # model x data x kernels
    Rule("seq-exceeds-context", {"data": "seq_len", "model": "max_position"},
         lambda c, e: c.data.seq_len > c.model.arch.max_position,
         lambda c, e: f"data.seq_len={c.data.seq_len} exceeds model={c.model.name}'s context of "
                      f"{c.model.arch.max_position}; set data.seq_len<={c.model.arch.max_position}"),
    Rule("attention-choice", {"model": "attn_implementation"},
         lambda c, e: c.model.attn_implementation not in ATTENTION,
         lambda c, e: f"model.attn_implementation={c.model.attn_implementation!r} is not one of {', '.join(ATTENTION)}"),
    Rule("flash-attn-on-cpu", {"hardware": "cpu", "attention": "flash_attention_2/3"},
         lambda c, e: c.model.attn_implementation in FLASH and _dev(c) != "cuda",
         "model.attn_implementation=flash_attention_* needs a CUDA GPU; use model.attn_implementation=sdpa"),
    Rule("flash-attn-needs-package", {"hardware": "cuda", "attention": "flash_attention_2/3"},
         lambda c, e: c.model.attn_implementation in FLASH and _dev(c) == "cuda"
         and not e.has(FLASH[c.model.attn_implementation]),
         "model.attn_implementation=flash_attention_* needs flash-attn: pip install flash-attn (or use sdpa)"),
    Rule("kernels-choice", {"kernels": "name"},
         lambda c, e: c.kernels not in KERNELS,
         lambda c, e: f"config field 'kernels' must be one of {', '.join(KERNELS)} (got {c.kernels!r})"),
    Rule("liger-on-cpu", {"hardware": "cpu", "kernels": "liger"},
         lambda c, e: c.kernels == "liger" and _dev(c) != "cuda",
         "kernels=liger are Triton GPU kernels; on CPU use kernels=none"),
    Rule("liger-needs-package", {"hardware": "cuda", "kernels": "liger"},
         lambda c, e: c.kernels == "liger" and _dev(c) == "cuda" and not e.has("liger_kernel"),
         "kernels=liger needs liger-kernel: pip install -e '.[liger]' (or use kernels=none)"),
    Rule("gguf-types", {"export": "gguf=<type>"},
         lambda c, e: c.train.export and any(str(t).lower() not in _gguf().TYPES for t in c.export.gguf),
         lambda c, e: f"export.gguf={list(c.export.gguf)}: choose from {list(_gguf().TYPES)}; K-quants "
                      "(q4_k_m, ...) need llama.cpp's llama-quantize on the f16 file"),
    Rule("gguf-family", {"export": "gguf", "model": "a family without a GGUF mapping"},
         lambda c, e: c.train.export and bool(c.export.gguf) and c.model.arch.family not in _gguf().ARCHES,
         lambda c, e: f"export.gguf: model family {c.model.arch.family!r} has no GGUF mapping here (supported: "
                      f"{sorted(_gguf().ARCHES)}); drop export.gguf and convert the merged folder with llama.cpp"),
    Rule("push-needs-token", {"export": "push_to_hub"},
         lambda c, e: c.train.export and bool(c.export.push_to_hub) and not e.hub_token,
         "export.push_to_hub needs a write token in $HF_TOKEN (checked now, not after training)"),
    # last, so that megatron's parallel-size rules report first when several apply
    Rule("lora-megatron-dropout", {"peft": "lora (dropout > 0)", "backend": "megatron"},
         lambda c, e: c.peft.kind == "lora" and _backend(c) == "megatron" and float(c.peft.dropout) > 0,
         lambda c, e: f"peft.dropout={c.peft.dropout}: LoRA on Megatron layers draws no dropout mask (the "
                      "column adapters' input is replicated over TP, so masks would have to agree across ranks); "
                      "set peft.dropout=0"),
    Rule("lora-megatron-targets", {"peft": "lora (target_modules)", "backend": "megatron"},
         lambda c, e: c.peft.kind == "lora" and _backend(c) == "megatron" and bool(_unmapped_targets(c)),
         lambda c, e: f"peft.target_modules: {_unmapped_targets(c)} have no Megatron linear to adapt; backend=megatron "
                      f"maps {sorted(_megatron_targets())} (or all-linear)"),
    Rule("megatron-family", {"backend": "megatron", "model": "a family without an HF<->Megatron mapping"},
         lambda c, e: _backend(c) == "megatron" and c.model.arch.family not in _megatron_families(),
         lambda c, e: f"backend=megatron has no HF<->Megatron mapping for model family {c.model.arch.family!r} "
                      f"(model={c.model.name}); use backend=fsdp2 for it"),
]


def _gguf():
    from workbench.export import gguf as to_gguf

    return to_gguf


def _megatron_targets():
    from workbench.megatron.lora import TARGETS

    return TARGETS


def _unmapped_targets(c) -> list[str]:
    wanted = c.peft.target_modules
    if wanted in ("all-linear", None):
        return []
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    return [t for t in wanted if t not in _megatron_targets()]


def _second_forward(c) -> str | None:
    """Why a method's loss would call the model twice per micro-batch, or None."""
    if _method(c) == "kto" and pick(c, "method.loss_type", "kto") == "kto":
        return "method=kto also runs its KL rows through it (use method.loss_type=apo_zero_unpaired)"
    if _ref(c) == "adapter":
        return f"method={_method(c)}'s reference is the adapter-free model, a second forward"
    return None


def _megatron_families():
    from workbench.megatron.model import FAMILIES

    return FAMILIES


def violations(cfg, env: Env | None = None) -> list[tuple[Rule, str]]:
    env = env or current_env()
    out = []
    for rule in RULES:
        if rule.broken(cfg, env):
            out.append((rule, rule.message(cfg, env)))
    return out


# rules that stand between a CPU machine and a plan: dry_run=true may still plan past them
PLANNABLE = {"push-needs-token", "cuda-not-visible", "multinode-needs-rendezvous", "planning-only-accelerator",
             "procs-exceed-gpus", "fp8-needs-torchao", "fp8-needs-sm89",
             "unsloth-needs-cuda", "unsloth-needs-package", "vllm-needs-cuda", "vllm-needs-package",
             "flash-attn-on-cpu", "flash-attn-needs-package", "liger-on-cpu", "liger-needs-package",
             "deepspeed-needs-package", "megatron-needs-package", "qlora-needs-bitsandbytes",
             "nvme-offload-needs-path", "megatron-sequence-parallel", "megatron-cp-needs-gpu"}


def runs_here(cfg) -> bool:
    """False when a launcher sends the run to other machines (their hardware is checked there)."""
    return pick(cfg, "launcher.name", "local") == "local"


def check(cfg, env: Env | None = None, planning: bool = False) -> list[str]:
    """Raise the first broken rule; rules about this machine only warn when planning
    (dry_run=true) or when a launcher runs the job elsewhere."""
    planning = planning or not runs_here(cfg)
    warnings = []
    for rule, msg in violations(cfg, env):
        if planning and rule.id in PLANNABLE:
            warnings.append(f"[{rule.id}] {msg}")
            continue
        raise UserError(f"[{rule.id}] {msg}")
    return warnings
