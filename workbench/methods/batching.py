"""A step's batch, as every method that trains on fixed data draws and cuts it: the one place
the global batch is shared between data-parallel ranks (workbench/data/mixing.py rank_share),
the overfit probe repeats its first batches (workbench/data/overfit.py), and this rank's rows
are cut into micro-batches of the run's size (`run.batch`, workbench/resolve/derive.py). A method
gives the draw, its collate and its loss.

    batcher = Batcher(ctx)
    drawn, mine = batcher.draw(state.step, self.mixture.take)     # the global batch, this rank's rows
    micro = batcher.cut([rows[i] for i in mine], collate)          # collate(rows) -> a micro-batch dict

GRPO is the exception: it draws prompts per generation batch, not per step, and cuts the
completions it samples by its own shape (workbench/methods/grpo_rules.py), with the same
rank_share and overfit probe.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.data.mixing import rank_share
from workbench.data.overfit import Overfit


class Batcher:
    def __init__(self, ctx):
        self.ctx = ctx  # read at each step: its run (layout, batch) and device
        self.overfit = Overfit(ctx.cfg.debug.overfit_batches)

    @property
    def micro(self) -> int:
        """Rows per micro-batch (run.batch.micro)."""
        return self.ctx.run.batch.micro

    def draw(self, step: int, take: Callable[[int], list]) -> tuple[list, list]:
        """(the step's global batch as every rank drew it, this rank's share of it); `take(n)`
        draws n items in the data's order (the overfit probe repeats its first draws)."""
        run = self.ctx.run
        return rank_share(run.layout, run.batch.per_rank, lambda n: self.overfit.take(step, lambda: take(n)))

    def cut(self, rows: list, collate: Callable[[list], dict], size: int | None = None) -> list[dict]:
        """`rows` cut into micro-batches of `size` (the run's), each collated and moved to the
        device."""
        size, device = size or self.micro, self.ctx.device
        return [{k: v.to(device) if hasattr(v, "to") else v for k, v in collate(rows[i:i + size]).items()}
                for i in range(0, len(rows), size)]
