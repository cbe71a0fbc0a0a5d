"""Deterministic, resumable weighted mixing of several sources.

Which source the next example comes from is decided by smooth weighted round-robin (each
draw adds every source's share to its credit and takes from the richest), so realised
proportions track the requested weights exactly, with no random state to restore. Within a
source, rows are visited in a seeded permutation per epoch. `state_dict()` captures the
position; after `load_state_dict()` the sequence continues at the exact next row: none read
twice, none skipped.

`rank_share` is how every method turns that one sequence into data-parallel batches:

    drawn, mine = rank_share(ctx.run.layout, per_rank, mixture.take)   # global batch, this rank's slice
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def rank_share(layout, per_rank: int, draw: Callable[[int], list[T]]) -> tuple[list[T], list[T]]:
    """(the global batch, this rank's slice of it): `draw(per_rank * layout.dp)`, then the
    `layout.dp_rank`-th run of `per_rank` items.

    Every data-parallel rank draws the whole global batch, in the same order, and keeps its
    slice. So the data position (a Mixture's or Packer's state) is the same on every rank: a
    checkpoint holds one position, a resume restores it without any communication, and the
    global batch does not depend on how many ranks share it. `layout` is the resolved run's
    (ctx.run.layout): its data-parallel size and rank, which under tensor or pipeline
    parallelism, or a launcher's own world size, differ from the processes requested.
    """
    n = per_rank * layout.dp
    drawn = draw(n)
    if len(drawn) != n:
        raise ValueError(f"drew {len(drawn)} items for a global batch of {per_rank} x {layout.dp} ranks")
    start = layout.dp_rank * per_rank
    return drawn, drawn[start:start + per_rank]


class Mixture:
    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        if not sizes or any(n <= 0 for n in sizes):
            raise ValueError(f"every source needs rows, got sizes {sizes}")
        total = float(sum(weights))
        self.sizes = list(sizes)
        self.shares = [w / total for w in weights]
        self.seed = seed
        self.credit = [0.0] * len(sizes)
        self.epoch = [0] * len(sizes)
        self.pos = [0] * len(sizes)
        self.taken = [0] * len(sizes)
        self._perm: dict[int, list[int]] = {}

    def _order(self, i: int) -> list[int]:
        if i not in self._perm or self._perm[i][0] != self.epoch[i]:
            order = list(range(self.sizes[i]))
            random.Random(f"{self.seed}/{i}/{self.epoch[i]}").shuffle(order)
            self._perm[i] = [self.epoch[i], order]
        return self._perm[i][1]

    def next(self) -> tuple[int, int]:
        """(source index, row index) of the next example."""
        for i, share in enumerate(self.shares):
            self.credit[i] += share
        i = max(range(len(self.credit)), key=lambda k: self.credit[k])
        self.credit[i] -= 1.0
        row = self._order(i)[self.pos[i]]
        self.pos[i] += 1
        self.taken[i] += 1
        if self.pos[i] == self.sizes[i]:
            self.epoch[i] += 1
            self.pos[i] = 0
        return i, row

    def take(self, n: int) -> list[tuple[int, int]]:
        """The next `n` (source index, row index) pairs."""
        return [self.next() for _ in range(n)]

    def realised(self) -> list[float]:
        n = sum(self.taken) or 1
        return [t / n for t in self.taken]

    def state_dict(self) -> dict:
        return {"credit": list(self.credit), "epoch": list(self.epoch), "pos": list(self.pos),
                "taken": list(self.taken), "seed": self.seed, "sizes": list(self.sizes)}

    def load_state_dict(self, state: dict) -> None:
        if list(state["sizes"]) != self.sizes:
            raise ValueError(f"resumed data has source sizes {self.sizes}, checkpoint had {state['sizes']}")
        self.credit = list(state["credit"])
        self.epoch = list(state["epoch"])
        self.pos = list(state["pos"])
        self.taken = list(state["taken"])
        self.seed = state["seed"]
        self._perm = {}
