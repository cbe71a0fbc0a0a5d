"""The process group: one place that starts it, whether a launcher started several processes or a
sharding backend runs on one.

    rank, world = init_distributed("cpu")     # from torchrun's environment; (0, 1) without one
    ensure_process_group("cpu")               # FSDP2 / Megatron on a single process need a group too

Numbers every rank must agree on (loss denominators, logged sums, "did any rank see a fault")
are reduced through one helper, a no-op on one process:

    reduce_scalar(denom)                      # summed over ranks, float64; op="max" | "min" | "mean"
    reduce_scalar(x, group=dp_group)          # over one Megatron-Core group
    all_max(peak), any_rank(bad, device)

Before a run is resolved (the launch side, data read while validating), what the launcher said
and what the config asks for are read through here:

    requested_procs(cfg.hardware)             # hardware.procs x hardware.nodes: what to launch
    launched_world(), launched_rank()         # WORLD_SIZE / RANK of a launched process, or None / 0
    is_main_process()                         # rank 0 (or no launcher): the one that prints
    launched_here()                           # a worker of workbench/launch/torchrun.py

A resolved run reads its layout instead (`ctx.run.layout`: rank, world, dp, dp_rank, is_main),
which workbench/resolve/derive.py builds from these.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

LAUNCHED_BY = "WORKBENCH_LAUNCHED_BY"  # set for its workers by workbench/launch/torchrun.py


def under_distributed_launcher() -> bool:
    """True inside torchrun / accelerate launch / a Ray or Slurm worker that set up ranks."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def launched_here() -> bool:
    """True in a worker that this workbench's own launcher started: the launcher prints the one
    failure line for every rank, so the worker stays quiet. False under a user's own torchrun."""
    return bool(os.environ.get(LAUNCHED_BY)) and under_distributed_launcher()


def requested_procs(hardware) -> int:
    """The processes a config asks for: hardware.procs per node x hardware.nodes."""
    return int(hardware.procs) * int(hardware.nodes)


def launched_world() -> int | None:
    """WORLD_SIZE of a launched process (torchrun, Slurm, Ray, the user's own launcher); None without one."""
    world = os.environ.get("WORLD_SIZE")
    return int(world) if world else None


def launched_rank() -> int:
    """RANK of a launched process; 0 without a launcher."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    """Whether this process is rank 0 of its job (the one that prints notes before the run is resolved)."""
    return launched_rank() == 0


def init_distributed(device: str, timeout_minutes: int = 30) -> tuple[int, int]:
    """Join the launcher's group (torchrun's RANK / WORLD_SIZE); returns (rank, world)."""
    world = launched_world() or 1
    if world > 1 and not dist.is_initialized():
        # The timeout bounds every collective: a dead peer fails the job instead of hanging it.
        kw = {}
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_ADDR" in os.environ:
            # After an elastic restart the agent's store (shared by every attempt) still holds the
            # dead attempt's peer addresses under the same keys; a per-attempt prefix keeps them
            # apart. Not where each round has its own store (an elastic job that admits nodes,
            # workbench/launch/torchrun.py): a node that joins counts its restarts from 0, so a
            # prefix by restart count would put it in another group than the survivors.
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                 is_master=False, timeout=timedelta(minutes=timeout_minutes))
            kw = {"store": dist.PrefixStore(f"workbench/attempt_{restart}", base), "rank": launched_rank(),
                  "world_size": world}
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo",
                                timeout=timedelta(minutes=timeout_minutes), **kw)
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def ensure_process_group(device: str, timeout_minutes: int = 30) -> None:
    """A one-process group when none runs (e.g. backend=fsdp2 hardware.procs=1). A file store,
    not a TCP port: nothing to race for between concurrent single-process runs."""
    if dist.is_initialized():
        return
    fd, path = tempfile.mkstemp(prefix="wb-pg-")
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{path}", rank=0,
                            world_size=1, timeout=timedelta(minutes=timeout_minutes))


def reduce_scalar(value, op: str = "sum", group=None, device=None, dtype: torch.dtype | None = torch.float64):
    """`value` (a number, or a sequence of numbers reduced in one collective) combined by `op`
    (sum | max | min | mean) over the ranks of `group` (None: all ranks). Returns Python numbers
    (a list for a sequence); `value` unchanged without a process group or with one rank in it.

    `dtype` (None: torch's default) is the arithmetic's: float64 (the default) adds per-rank
    sums without float32 rounding; integer dtypes give ints back. `device` (None: torch's
    default) is where the tensor lives for the collective: NCCL reduces CUDA tensors only,
    gloo CPU ones."""
    if op not in ("sum", "max", "min", "mean"):
        raise ValueError(f"reduce_scalar: op={op!r} is not one of sum, max, min, mean")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    many = isinstance(value, (list, tuple))
    t = torch.tensor(list(value) if many else [value], dtype=dtype, device=device)
    # mean is a sum divided here: ReduceOp.AVG is NCCL's only
    dist.all_reduce(t, op=getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()), group=group)
    if op == "mean":
        t = t / dist.get_world_size(group)
    return t.tolist() if many else t.item()


def all_max(value: float) -> float:
    """The largest value over ranks (the value itself without a process group)."""
    return reduce_scalar(value, "max")


def any_rank(flag: bool, device=None) -> bool:
    """True when `flag` is true on any rank (`flag` itself without a process group)."""
    return bool(reduce_scalar(1.0 if flag else 0.0, "max", device=device, dtype=None) > 0)
