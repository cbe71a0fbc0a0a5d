"""When a supervised run stops learning: the watch over the training loss of the methods that
learn from fixed data (SFT and the preference methods: DPO, KTO, CPO, ORPO, the reward model).

GRPO's steps can carry no gradient, and its own watch says so (workbench/train/signal.py); a
supervised step always has one, yet its loss can stop falling: Gemma 3 270M on the arithmetic
recipe, on one seed, fell to ~1.0 by step 30 and then sat between 0.8 and 1.0 until step 200,
ending at 18% held out where the other seeds reach 98-99%, and nothing in the run said so. This
watch says so, in one `warning:` line, and the run's end (the `done:` lines and report.md)
repeats it.

The rule, with S = `train.stall_steps` (0: off) and W = max(1, S // 5) steps:

    a W-step mean of the loss is taken at every step from the W-th on;
    at step t, `before` is the lowest such mean ending at step t - S or earlier,
               `recent` the lowest ending in the S steps after it (t - S, t];
    the loss has stalled when recent > (1 - IMPROVE) x before, and recent >= FITTED.

That is: in the last S steps no W-step mean came IMPROVE (5%) below the best one before them,
and the loss is not already near zero. Taking the lowest mean on both sides compares like with
like: a lucky low window before the S steps is matched by the lucky windows inside them, so noise
alone neither raises nor hides a stall. The warning comes once per stall; a later mean IMPROVE
below `before` ends it (the end summary says from which step), and a new stall warns again.
A run shorter than S + W steps is never judged; a resumed run is watched from its resume.

    watch = LossWatch.of(run)                 # None: a generating method, or train.stall_steps=0
    line = watch.after(step, loss)            # None, or the warning to print
    lines = end_lines(results)                # the stalls again, for the `done:` lines and report.md
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# A stall is no W-step mean IMPROVE below the best before the last S steps. Measured stalls move
# far less: the reward model trained on "wrong number" pairs went 0.694 -> 0.687 over 50 steps
# (1%; docs/measurements/learning.md), and a flat band like Gemma's 0.8-1.0 gives 10-step means
# whose lowest before and inside 100 steps differ by a few %. Healthy runs move far more in 100
# steps: the default SmolLM2 run ~2 -> ~0.1 in 150, Gemma's seed 0 0.12 -> 0.004 from step 100
# to 300 (a factor of ~5 per 100 steps).
IMPROVE = 0.05
# A loss whose best recent W-step mean is below this is a fitted training set, not a stall:
# Gemma's healthy seed sits at a few thousandths from step ~200 on, where a 5% change is noise;
# every stall measured sat at 0.5 or above (Gemma's 0.8-1.0, a preference loss at log 2 = 0.69).
FITTED = 0.05


@dataclass
class LossWatch:
    stall_steps: int  # S: steps without a W-step mean IMPROVE below the best before them
    window: int  # W: losses per mean
    losses: list[float] = field(default_factory=list)  # the finite losses, in order
    steps: list[int] = field(default_factory=list)  # the step each loss was logged at
    means: list[float] = field(default_factory=list)  # means[i]: the W losses ending at losses[i + W - 1]
    stalls: list[dict] = field(default_factory=list)  # every stall warned about, the last maybe ongoing
    _before: int | None = None  # index of the lowest mean before the last S
    _recent: deque = field(default_factory=deque)  # indices of the last S means, their means increasing

    @classmethod
    def of(cls, run) -> LossWatch | None:
        """The watch for `run` (workbench/resolve/derive.py Run); None for the generating methods
        (GRPO's loss is ~0 by construction, on-policy distillation's changes with what it
        samples) and with train.stall_steps=0."""
        steps = int(run.cfg.train.get("stall_steps", 0) or 0)
        if steps <= 0 or run.facts.generates:
            return None
        return cls(stall_steps=steps, window=window_for(steps))

    @property
    def ongoing(self) -> dict | None:
        return self.stalls[-1] if self.stalls and self.stalls[-1]["recovered_at"] is None else None

    def after(self, step: int, loss: float) -> str | None:
        """Account the loss of the step just trained; the warning when a stall begins here."""
        if not (isinstance(loss, (int, float)) and math.isfinite(loss)):
            return None  # a skipped non-finite step (train.max_bad_steps) says nothing of learning
        self.losses.append(float(loss))
        self.steps.append(int(step))
        w, s = self.window, self.stall_steps
        if len(self.losses) < w:
            return None
        self.means.append(sum(self.losses[-w:]) / w)
        i = len(self.means) - 1
        # the lowest mean of the last S, kept in O(1) a step: indices whose means increase
        while self._recent and self.means[self._recent[-1]] >= self.means[i]:
            self._recent.pop()
        self._recent.append(i)
        split = len(self.means) - s  # the means before it end at step t - S or earlier
        if split < 1:
            return None
        if self._recent[0] < split:
            self._recent.popleft()
        if self._before is None or self.means[split - 1] < self.means[self._before]:
            self._before = split - 1
        b, r = self._before, self._recent[0]
        before, recent = self.means[b], self.means[r]
        stalled = recent > (1 - IMPROVE) * before and recent >= FITTED
        now = self.ongoing
        if now is not None:
            if not stalled:
                now["recovered_at"], now["recovered_mean"] = int(step), recent
            return None
        if not stalled:
            return None
        last = self.losses[-w:]
        self.stalls.append({
            "since": self.steps[b + w - 1], "step": int(step), "stall_steps": s, "window": w,
            "best": before, "best_steps": [self.steps[b], self.steps[b + w - 1]],
            "recent_best": recent, "last_mean": sum(last) / w, "last_range": [min(last), max(last)],
            "recovered_at": None, "recovered_mean": None})
        return "warning: " + describe(self.stalls[-1]) + HINT


# what to try, after the warning (not repeated at the end: the run is over by then)
HINT = ("; try another optim.lr or train.seed, or look at the data (train.stall_steps: how many steps "
        "without improvement make a stall, 0 turns this off)")


def window_for(stall_steps: int) -> int:
    """W, the losses each mean takes: a fifth of the stall (20 of 100 steps). Each step's loss is
    one batch's, and a short mean lets noise pass for a stall: made-up curves shaped like the
    default run (2 -> 0.1 in 150 steps, then 22% lower per 100 steps) with each step 0.6-1.4x its
    trend warned on 7 seeds of 200 by step 300 at W = 10, on 1 at W = 20 (none of 1000 within the
    150 steps the default run has), while a flat 0.8-1.0 band warns by step 145 at either."""
    return max(1, stall_steps // 5)


def describe(stall: dict) -> str:
    """The stall in one sentence: what stalled, since which step, the best loss and when, the
    current loss window."""
    w, (lo, hi) = stall["window"], stall["last_range"]
    a, b = stall["best_steps"]
    mean = "loss" if w == 1 else f"{w}-step mean loss"
    best = f"(step {b})" if w == 1 else f"(steps {a}-{b})"
    last = (f"the last step's loss: {stall['last_mean']:.4g}" if w == 1 else
            f"the last {w} steps' loss: mean {stall['last_mean']:.4g}, {lo:.4g}-{hi:.4g}")
    return (f"the training loss has not improved for {stall['step'] - stall['since']} steps (since step "
            f"{stall['since']}): its best {mean} was {stall['best']:.4g} {best} and none in the "
            f"{stall['stall_steps']} steps up to step {stall['step']} came {IMPROVE:.0%} below it (their best "
            f"{stall['recent_best']:.4g}); {last}")


def end_lines(results: dict) -> list[str]:
    """Each stall of the run again, for its end (workbench/run/finish.py summary, report.md):
    as warned, and whether the loss improved again later."""
    out = []
    for stall in results.get("loss_stall") or []:
        again = (f"; it improved again at step {stall['recovered_at']} (a {stall['window']}-step mean of "
                 f"{stall['recovered_mean']:.4g})" if stall.get("recovered_at") is not None
                 else "; it had not improved again when the run ended")
        out.append("warning: " + describe(stall) + again)
    return out


def watch_loss(watch: LossWatch | None, row: dict, say, results: dict) -> None:
    """The loop's call after each step's metrics row: a warning on the console (`say`), and the
    stalls kept in `results["loss_stall"]` for the end summary and results.json."""
    if watch is None:
        return
    line = watch.after(row["step"], row.get("loss"))
    if line:
        say(line)
    if watch.stalls:
        results["loss_stall"] = watch.stalls
