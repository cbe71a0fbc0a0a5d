"""Verdict per hardware profile, and the smallest change that makes a run fit.

A change is a Setup the run could be given instead of its own, named by the command-line
overrides that give it (`label`). They are tried in order of how little they alter the run:
one at a time (checkpointing, a smaller micro-batch, sharding over the devices already there,
optimizer offload, adapters, a 4-bit base; on a model-parallel backend its own tensor/pipeline/
expert sizes and distributed optimizer instead of sharding and offload, only what the backend
supports), then cumulatively, dropping afterwards each earlier change the later ones made
unneeded. A model-parallel run whose own layouts all fail (Megatron keeps a whole HF model on
every device for generation or export, which no layout splits) is tried on the backend that
shards parameters (FSDP2) the same way. Separately, the number of devices that fits is searched
in whole nodes of the profile. The backends are chosen by their facts
(workbench/backends/spec.py), not by name. `accept` lets the caller refuse a change the rule
table would refuse (workbench/plan/make.py checks each on the real config).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workbench.backends import registry as backends
from workbench.plan.memory import estimate

GiB = 2**30
HEADROOM = 0.9  # allocator fragmentation, CUDA context, communication buffers
PARALLEL_SIZES = (2, 4, 8)  # tensor/pipeline/expert sizes tried: within a node


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_gb: float
    usable_gb: float
    fix: str | None  # smallest change that fits ('' when it fits already, None when none found)
    fix_peak_gb: float | None
    devices_needed: int | None  # with checkpointing and sharding, whole nodes of this profile
    needed_backend: str | None = None  # the backend `devices_needed` is counted with
    fixed: object | None = None  # the Setup of `fix` (the planner's record of the changed run)


def usable_bytes(memory_gb: float, device: str, vllm_fraction: float = 0.0) -> float:
    head = 1.0 if device == "cpu" else HEADROOM
    return memory_gb * GiB * head * (1.0 - vllm_fraction)


def sharding_backend() -> tuple[str, int]:
    """The backend that shards parameters at its default stage (FSDP2), and that stage."""
    name, spec = next((n, sp) for n, sp in backends.SPECS.items() if sp.facts.shards())
    return name, spec.facts.default_stage


def offload_backend() -> tuple[str, int, str]:
    """The backend with an option that moves just the optimizer state to the host (DeepSpeed),
    the stage at which it shards the parameters as well, and the option."""
    name, spec = next((n, sp) for n, sp in backends.SPECS.items()
                      if sp.facts.optimizer_offload and sp.facts.shards_from_stage is not None)
    return name, spec.facts.shards_from_stage, spec.facts.optimizer_offload


def off_model_parallel(s):
    """The same run on the backend that shards parameters, at its default layout: no tensor/
    pipeline/expert split, no Megatron optimizer and no bridged HF copy (those are Megatron's)."""
    name, stage = sharding_backend()
    return s.but(backend=name, stage=stage, tp=1, pp=1, cp=1, ep=1, distributed_optimizer=False, hf_copy=False)


def valid(s, arch) -> bool:
    """Whether the parallel sizes make a layout (the rules tp-divides-heads, pp-divides-layers,
    parallel-divides-world and ep-needs-experts, on the planner's fields)."""
    kv = arch.kv_heads or arch.heads
    mp = s.tp * s.pp * s.cp
    return (s.devices % mp == 0 and arch.heads % s.tp == 0 and kv % s.tp == 0 and arch.layers % s.pp == 0
            and (s.ep == 1 or bool(arch.experts) and arch.experts % s.ep == 0 and s.devices // mp % s.ep == 0))


def _steps(s, arch) -> list[dict]:
    """The changes to try, each as Setup fields, in order of how little they alter the run."""
    out = []
    f = s.facts
    if s.checkpointing != "full":
        out.append(dict(checkpointing="full"))
    if s.micro_batch > 1:
        out.append(dict(micro_batch=1, grad_accum=s.micro_batch * s.grad_accum))
    if f.model_parallel:  # its own sizes over the devices there: what the backend shards by
        out += [dict(tp=t) for t in PARALLEL_SIZES if t > s.tp and valid(s.but(tp=t), arch)]
        out += [dict(pp=p) for p in PARALLEL_SIZES if p > s.pp and valid(s.but(pp=p), arch)]
        if arch.experts:
            out += [dict(ep=e) for e in PARALLEL_SIZES if e > s.ep and valid(s.but(ep=e), arch)]
        if not s.distributed_optimizer and s.devices > 1 and s.optimizer == "adamw" and s.precision != "fp16":
            out.append(dict(distributed_optimizer=True))  # the rules megatron-distopt-adam/-fp16
    else:
        if s.devices > 1 and not s.shards_params:
            name, stage = sharding_backend()
            out.append(dict(backend=name, stage=stage))
        if not s.offload_optimizer:
            name, stage, _ = offload_backend()
            out.append(dict(backend=name, stage=stage, offload_optimizer=True))
    if not s.adapter:
        out.append(dict(peft="lora"))
    if not s.quantised and f.loads_4bit:  # no 4-bit Megatron layers
        out.append(dict(peft="qlora"))
    return out


def label(s0, s1) -> str:
    """The command-line overrides that take the run of Setup `s0` to `s1`."""
    out = []
    f0, f1 = s0.facts, s1.facts
    moved = s1.backend != s0.backend
    if moved:
        out.append(f"backend={s1.backend}")
        if f1.shards_from_stage is not None and not f1.default_stage:  # a backend with a stage option
            out.append(f"backend.stage={s1.stage}")
    if s1.offload_optimizer and not s0.offload_optimizer and f1.optimizer_offload:
        out.append(f"backend.{f1.optimizer_offload}=cpu")
    if f1.model_parallel:
        out += [f"backend.{k}={getattr(s1, k)}" for k in ("tp", "pp", "ep") if getattr(s1, k) != getattr(s0, k)]
    if s1.distributed_optimizer and not s0.distributed_optimizer:
        out.append("backend.distributed_optimizer=true")
    if s1.checkpointing == "full" and (s0.checkpointing != "full" or moved):
        field = f1.checkpointing_field
        out.append(f"backend.{field}=full" if field else "model.gradient_checkpointing=true")
        if field and moved and not f0.checkpointing_field and s0.checkpointing == "full":
            out.append("model.gradient_checkpointing=false")  # the rule fsdp2-model-checkpointing
    if s1.micro_batch != s0.micro_batch:
        out.append(f"train.micro_batch_size={s1.micro_batch} train.grad_accum={s1.grad_accum}")
    if s1.peft != s0.peft:
        out.append(f"peft={s1.peft}")
    return " ".join(out)


def _search(s, arch, ok: Callable) -> object | None:
    """The first change of `_steps(s)` that is `ok`, else the shortest run of them that is, less
    each earlier change the later ones make unneeded; None when even all of them are not."""
    steps = _steps(s, arch)
    for kw in steps:
        t = s.but(**kw)
        if valid(t, arch) and ok(t):
            return t
    used, acc = [], s
    for kw in steps:
        nxt = acc.but(**kw)
        if not valid(nxt, arch):  # e.g. a pipeline size that no longer divides the devices left
            continue
        used.append(kw)
        acc = nxt
        if ok(acc):
            for kw_ in list(used[:-1]):  # a larger TP makes a smaller one, or checkpointing, moot
                trial = [k for k in used if k is not kw_]
                t = _apply(s, trial)
                if valid(t, arch) and ok(t):
                    used = trial
            return _apply(s, used)
    return None


def _apply(s, steps: list[dict]):
    for kw in steps:
        s = s.but(**kw)
    return s


def verdict(counts, arch, s, memory_gb: float, device: str, node_size: int = 1,
            accept: Callable[[str], bool] | None = None) -> Verdict:
    """Whether Setup `s` fits a device of `memory_gb`, and if not the smallest change that does.
    `accept(label)`: False for a change the caller knows the run would refuse."""
    est = estimate(counts, arch, s)
    usable = usable_bytes(memory_gb, device, est.vllm_fraction)
    if memory_gb <= 0:
        return Verdict(False, est.peak / GiB, 0.0, None, None, None)
    if est.peak <= usable:
        return Verdict(True, est.peak / GiB, usable / GiB, "", None, s.devices, s.backend)
    peaks = {}

    def ok(t) -> bool:
        e = estimate(counts, arch, t)
        if e.peak > usable_bytes(memory_gb, device, e.vllm_fraction):
            return False
        peaks[t] = e.peak
        return accept is None or accept(label(s, t))

    fixed = _search(s, arch, ok)
    if fixed is None and s.facts.model_parallel:  # no layout of its own fits: the sharding backend
        base = off_model_parallel(s)
        fixed = base if ok(base) else _search(base, arch, ok)
    needed, backend = devices_needed(counts, arch, s, memory_gb, device, node_size)
    if fixed is None:
        return Verdict(False, est.peak / GiB, usable / GiB, None, None, needed, backend)
    return Verdict(False, est.peak / GiB, usable / GiB, label(s, fixed), peaks[fixed] / GiB, needed, backend, fixed)


def devices_needed(counts, arch, s, memory_gb: float, device: str, node_size: int = 1,
                   limit: int = 65536) -> tuple[int | None, str | None]:
    """Fewest devices (whole nodes) on which the run fits with checkpointing, sharded by the backend
    that shards parameters (FSDP2), or with its own layout on a model-parallel backend (and where
    that never fits, FSDP2's); with the backend counted."""
    if memory_gb <= 0:
        return None, None
    bases = [off_model_parallel(s).but(checkpointing="full")]
    if s.facts.model_parallel:
        bases.insert(0, s.but(checkpointing="full"))
    for base in bases:
        k, node = 1, max(node_size, 1)
        while node * k <= limit:  # 1, 2, 4, ... nodes
            e = estimate(counts, arch, base.but(devices=node * k))
            if e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction):
                return node * k, base.backend
            k *= 2
    return None, None
