"""The training progress display: a rich bar (step/total, loss, tokens/s, time left) when
stdout is a terminal; otherwise the plain log line the run prints every `train.log_every` steps
(CI logs, Slurm, Modal, RunPod) carries step/total and the time left.

`status(text)` wraps other long work (evaluation, checkpoint saves) the same way.

The bar costs nothing per step that matters: `update` stores a few numbers and rich redraws
from its own thread a few times a second (scripts/bench.py progress measures steps/s with and
without it). Log lines printed while the bar is up go above it (`print`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time


def fmt_seconds(s: float) -> str:
    s = max(0, int(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def interactive() -> bool:
    """A person is watching: stdout is a terminal (WORKBENCH_PROGRESS=plain|rich forces a mode)."""
    forced = os.environ.get("WORKBENCH_PROGRESS", "")
    if forced in ("plain", "rich"):
        return forced == "rich"
    return sys.stdout.isatty()


class Progress:
    def __init__(self, total: int, every: int, console, enabled: bool = True, rich: bool | None = None):
        self.total, self.every, self.console = int(total), max(1, int(every)), console
        self.enabled = enabled and total > 0
        self.rich = (interactive() and getattr(console, "is_terminal", True)) if rich is None else rich
        self._bar = None
        self._task = None
        self._t0 = None
        self._first_step = None

    # Time left from the steps after the first (the first pays for warm-up and compilation).
    def eta(self, step: int) -> float | None:
        if self._first_step is None or step <= self._first_step[0]:
            return None
        s0, t0 = self._first_step
        per_step = (time.perf_counter() - t0) / (step - s0)
        return per_step * (self.total - step)

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        step = int(row.get("step", 0))
        if self._first_step is None:
            self._first_step = (step, time.perf_counter())
        if self.rich:
            self._update_bar(step, row)

    def suffix(self, step: int) -> str:
        """`  [12/150 8% 0:42 left]` for the plain log line of `step`."""
        if not self.enabled:
            return ""
        eta = self.eta(step)
        left = f" {fmt_seconds(eta)} left" if eta is not None else ""
        return f"  [{step}/{self.total} {step / self.total:.0%}{left}]"

    def _update_bar(self, step: int, row: dict) -> None:
        if self._bar is None:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[stats]}", markup=False), TimeRemainingColumn(),
                                     console=self.console, transient=False, refresh_per_second=4)
            self._task = self._bar.add_task("train", total=self.total, stats="")
            self._bar.start()
        stats = f"loss {row.get('loss', float('nan')):.4f}  {row.get('tokens_per_s', 0):.0f} tok/s"
        self._bar.update(self._task, completed=step, stats=stats)

    @contextlib.contextmanager
    def status(self, text: str):
        """Long work outside a training step (evaluation, a checkpoint save): shown in the bar's
        stats while the bar is up, as a spinner on a terminal before it, as a line otherwise."""
        if not self.enabled:
            yield
            return
        t = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, stats=f"{text} ...")
            yield
        elif self.rich:
            with self.console.status(f"{text} ..."):
                yield
        else:
            self.print(f"{text} ...")
            yield
        if not self.rich:
            self.print(f"{text}: {time.perf_counter() - t:.1f} s")

    def print(self, text: str) -> None:
        # soft_wrap: a log line stays one line in CI logs whatever width rich assumes; no markup:
        # "eval [end]" is text, not a style tag
        (self._bar.console if self._bar is not None else self.console).print(text, soft_wrap=True, markup=False)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
