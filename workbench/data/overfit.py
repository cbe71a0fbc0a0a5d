"""debug.overfit_batches=N: every method repeats the first N batches it draws, in turn.

    python -m workbench debug=overfit              # N=1: the loss must fall towards zero

The same check for every method: SFT and DPO repeat their rows, GRPO repeats its prompts (the
completions are sampled anew each time, so the reward must rise on those prompts).
"""

from __future__ import annotations

from collections.abc import Callable


class Overfit:
    def __init__(self, n: int):
        self.n = int(n)
        self.kept: list | None = None

    def take(self, index: int, draw: Callable[[], list]) -> list:
        """The batch for step (or generation batch) `index`: drawn anew when off, else the
        first N draws, kept, in turn."""
        if not self.n:
            return draw()
        if self.kept is None:
            self.kept = [draw() for _ in range(self.n)]
        return self.kept[index % self.n]
