"""The run's ranks and parallel degrees: who trains on which slice of the global batch.

    from workbench.train.layout import layout
    lay = layout(cfg)          # lay.world, lay.dp, lay.dp_rank, lay.tp, lay.pp, lay.cp, lay.sp

A low-level module on purpose: the resolved run (workbench/resolve/derive.py) carries it as
`run.layout`, and the rules of one backend or method (workbench/config/rule.py) read it
without importing the run layer above them.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config import rule
from workbench.train import distributed


@dataclass(frozen=True)
class Layout:
    """Ranks and parallel degrees. Megatron orders ranks tensor-fastest, then context, then data,
    then pipeline, so the data-parallel rank of global rank r is (r // (tp * cp)) % dp. Sequence
    parallelism (backend.sp, workbench/train/sequence_parallel.py) groups consecutive ranks the
    same way: the sp ranks of one data-parallel rank hold slices of the same rows."""

    rank: int = 0
    world: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    sp: int = 1

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp * self.sp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same model slice: what ZeRO and FSDP2 shard over. The sp ranks of
        one data-parallel rank are among them (they shard like data-parallel replicas)."""
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def dp(self) -> int:
        """Ranks that take their own rows of the global batch: the replicas over the sp ranks
        sharing a row (world // (tp * pp * cp * sp))."""
        return max(1, self.replicas // self.sp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp * self.sp)) % self.dp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def layout(cfg, rank: int | None = None, world: int | None = None) -> Layout:
    """Inside a launched process the launcher's RANK / WORLD_SIZE are the truth; before launch,
    the request (hardware.procs x hardware.nodes). The parallel degrees are the backend's
    tp / pp / cp / sp where its options have them (1 otherwise)."""
    if world is None:
        world = distributed.launched_world() or distributed.requested_procs(cfg.hardware)
    if rank is None:
        rank = distributed.launched_rank()
    return Layout(rank=rank, world=world, **rule.degrees(cfg))
