"""Verdict per hardware profile, and the smallest change that makes a run fit.

Changes are tried one at a time in order of how little they alter the run (checkpointing,
a smaller micro-batch, sharding over the devices already there (Megatron: the next tensor-parallel
size the heads and devices allow), optimizer offload, adapters, 4-bit base; only what the backend
supports), then cumulatively; separately, the number of devices that fits with FSDP2 is
searched in whole nodes of the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    devices_needed: int | None  # with backend=fsdp2 (and checkpointing), whole nodes of this profile


def usable_bytes(memory_gb: float, device: str, vllm_fraction: float = 0.0) -> float:
    head = 1.0 if device == "cpu" else HEADROOM
    return memory_gb * GiB * head * (1.0 - vllm_fraction)


def _changes(s, arch):
    out = []
    if s.checkpointing != "full":
        out.append(("model.gradient_checkpointing=true", dict(checkpointing="full")))
    if s.micro_batch > 1:
        out.append((f"train.micro_batch_size=1 train.grad_accum={s.micro_batch * s.grad_accum}",
                    dict(micro_batch=1, grad_accum=s.micro_batch * s.grad_accum)))
    if s.backend == "megatron":  # Megatron shards by tensor parallelism: a larger TP over the devices there
        kv = arch.kv_heads or arch.heads
        out += [(f"backend.tp={t}", dict(tp=t)) for t in (2, 4, 8)
                if s.tp < t <= s.devices and s.devices % t == 0 and arch.heads % t == 0 and kv % t == 0]
    if s.devices > 1 and not s.shards_params and s.backend != "megatron":
        out.append(("backend=fsdp2", dict(backend="fsdp2", stage=3)))
    if not s.offload_optimizer and s.backend != "megatron":
        out.append(("backend=deepspeed backend.stage=3 backend.offload_optimizer=cpu",
                    dict(backend="deepspeed", stage=3, offload_optimizer=True)))
    if s.peft == "none":
        out.append(("peft=lora", dict(peft="lora")))
    if s.peft in ("none", "lora", "dora") and s.backend != "megatron":  # no 4-bit Megatron layers
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
    """Fewest devices (whole nodes) on which the run fits sharded with FSDP2 and checkpointing."""
    if memory_gb <= 0:
        return None
    base = s.but(checkpointing="full") if s.backend == "megatron" else \
        s.but(backend="fsdp2", stage=3, checkpointing="full")
    k, node = 1, max(node_size, 1)
    while node * k <= limit:  # 1, 2, 4, ... nodes
        e = estimate(counts, arch, base.but(devices=node * k))
        if e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction):
            return node * k
        k *= 2
    return None
