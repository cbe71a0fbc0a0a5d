"""Verdict per hardware profile, and the smallest change that makes a run fit.

Changes are tried one at a time in order of how little they alter the run (checkpointing,
a smaller micro-batch, sharding over the devices already there (Megatron: the next tensor-parallel
size the heads and devices allow), optimizer offload, adapters, 4-bit base; only what the backend
supports), then cumulatively; separately, the number of devices that fits with the backend that
shards parameters (FSDP2) is searched in whole nodes of the profile. The backends are chosen by
their facts (workbench/backends/spec.py), not by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.backends import registry as backends
from workbench.plan.memory import estimate

GiB = 2**30
HEADROOM = 0.9  # allocator fragmentation, CUDA context, communication buffers


@dataclass(frozen=True)
class Verdict:
    fits: bool
    peak_gb: float
    usable_gb: float
    fix: str | None  # smallest change that fits ('' when it fits already, None when none found)
    fix_peak_gb: float | None
    devices_needed: int | None  # with the sharding backend (and checkpointing), whole nodes of this profile


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


def _changes(s, arch):
    out = []
    f = s.facts
    if s.checkpointing != "full":
        out.append(("model.gradient_checkpointing=true", dict(checkpointing="full")))
    if s.micro_batch > 1:
        out.append((f"train.micro_batch_size=1 train.grad_accum={s.micro_batch * s.grad_accum}",
                    dict(micro_batch=1, grad_accum=s.micro_batch * s.grad_accum)))
    if f.model_parallel:  # Megatron shards by tensor parallelism: a larger TP over the devices there
        kv = arch.kv_heads or arch.heads
        out += [(f"backend.tp={t}", dict(tp=t)) for t in (2, 4, 8)
                if s.tp < t <= s.devices and s.devices % t == 0 and arch.heads % t == 0 and kv % t == 0]
    # a model-parallel run keeps its backend: its tp/pp/ep layout has no data-parallel equivalent
    if s.devices > 1 and not s.shards_params and not f.model_parallel:
        name, stage = sharding_backend()
        out.append((f"backend={name}", dict(backend=name, stage=stage)))
    if not s.offload_optimizer and not f.model_parallel:
        name, stage, option = offload_backend()
        out.append((f"backend={name} backend.stage={stage} backend.{option}=cpu",
                    dict(backend=name, stage=stage, offload_optimizer=True)))
    if s.peft == "none":
        out.append(("peft=lora", dict(peft="lora")))
    if s.peft in ("none", "lora", "dora") and f.loads_4bit:  # no 4-bit Megatron layers
        out.append(("peft=qlora", dict(peft="qlora")))
    return out


def verdict(counts, arch, s, memory_gb: float, device: str, node_size: int = 1) -> Verdict:
    est = estimate(counts, arch, s)
    usable = usable_bytes(memory_gb, device, est.vllm_fraction)
    if memory_gb <= 0:
        return Verdict(False, est.peak / GiB, 0.0, None, None, None)
    if est.peak <= usable:
        return Verdict(True, est.peak / GiB, usable / GiB, "", None, s.devices)
    fix, fix_peak = None, None
    changes = _changes(s, arch)
    for label, kw in changes:  # one change
        e = estimate(counts, arch, s.but(**kw))
        if e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction):
            fix, fix_peak = label, e.peak
            break
    if fix is None:  # cumulative, in the same order
        acc, labels = s, []
        for label, kw in changes:
            acc = acc.but(**kw)
            if "tp" in kw:  # a larger TP replaces a smaller one
                labels = [x for x in labels if not x.startswith("backend.tp=")]
            labels.append(label)
            e = estimate(counts, arch, acc)
            if e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction):
                fix, fix_peak = " ".join(labels), e.peak
                break
    return Verdict(False, est.peak / GiB, usable / GiB, fix, fix_peak / GiB if fix_peak else None,
                   devices_needed(counts, arch, s, memory_gb, device, node_size))


def devices_needed(counts, arch, s, memory_gb: float, device: str, node_size: int = 1,
                   limit: int = 65536) -> int | None:
    """Fewest devices (whole nodes) on which the run fits with checkpointing, sharded by the backend
    that shards parameters (FSDP2), or with its own layout on a model-parallel backend."""
    if memory_gb <= 0:
        return None
    if s.facts.model_parallel:
        base = s.but(checkpointing="full")
    else:
        name, stage = sharding_backend()
        base = s.but(backend=name, stage=stage, checkpointing="full")
    k, node = 1, max(node_size, 1)
    while node * k <= limit:  # 1, 2, 4, ... nodes
        e = estimate(counts, arch, base.but(devices=node * k))
        if e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction):
            return node * k
        k *= 2
    return None
