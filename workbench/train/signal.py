"""When a run stops learning: the watch over methods whose steps can carry no gradient (GRPO).

A GRPO group whose completions all score alike carries no gradient (its advantages are zero); a
step where every group is like that is the update of Adam's momentum alone. A method that can
stall says each step which share of what it trains on carries signal (`StepBatch.signal`, over
all ranks) and names the quantities whose collapse explains a stall (`Method.stall_watch`:
completion length, entropy, reward spread). The watch

- warns once when `warn_after` steps in a row mostly carried no signal (once per such stretch),
  saying what that means, what collapsed (each watched quantity at the first step and now, the
  ones that fell by more than half first) and what to try; a run shorter than `warn_after`
  steps (`last_step`) in which no step had signal says so at its last step;
- checkpoints the weights of the last step that had signal, when a stall begins (before the
  first step without signal trains), so that they can be exported;
- ends the run after `stop_after` steps in a row without signal (`method.stop_on_stall`): the
  runner then evaluates and exports those weights, and results.json and report.md say why the
  run stopped, at which step, and which checkpoint was exported.

The run's end states how many of its steps had any signal (the `signal_share` each GRPO step
logs; workbench/run/finish.py, report.md), whatever the watch said along the way.

    watch = StallWatch(stop_after=10, warn_after=3, watched=("completion_length", "entropy"), last_step=100)
    if watch.begins(batch.signal, step):  runner saves a checkpoint (the last weights with signal)
    report = watch.after(row, batch.signal)   # None, or the stall report when the run must stop
    line = watch.warning(row, batch.signal)    # None, or the warning to print
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# a watched quantity "collapsed" when it fell to at most this share of its first-step value
COLLAPSED = 0.5
# a step is "mostly without signal" (worth a warning) below this share of signal-carrying groups
LOW_SIGNAL = 0.5

# what no reward spread means, in the warning
MEANING = ("a group whose completions all scored the same has advantages of 0 and adds no gradient; "
           "a step with no spread at all trains on nothing (loss and grad_norm 0, a KL term aside)")

LABELS = {"completion_length": "completion length (tokens)", "entropy": "entropy (nats/token)",
          "reward_std": "reward std", "zero_std_groups": "groups without reward spread"}


@dataclass
class StallWatch:
    stop_after: int  # steps in a row without signal that end the run (0: never)
    warn_after: int  # steps in a row mostly without signal before the warning (0: never)
    watched: tuple[str, ...]  # metrics-row keys whose collapse explains a stall
    hint: str = ""  # what the method suggests trying
    last_step: int = 0  # the run's last step (train.max_steps); 0: unknown
    first: dict[str, float] = field(default_factory=dict)  # the watched values at the first step
    idle: int = 0  # steps in a row without any signal
    low: int = 0  # steps in a row where most of the step carried no signal
    last_signal_step: int = 0  # the weights after this step are the last trained with signal
    checkpoint: str | None = None  # where those weights were saved
    steps: int = 0  # steps accounted in this run (a resumed run counts from its resume)

    def begins(self, signal: float, step: int) -> bool:
        """Whether the step about to train starts a stall (none of its batch carries signal, the
        last one's did): the runner checkpoints the weights as they are, the last with signal."""
        return signal == 0 and self.idle == 0 and step > 0 and self.stop_after > 0

    def after(self, row: dict, signal: float) -> dict | None:
        """Account the step just trained (its metrics row and the share of it that carried
        signal); the stall report when the run must stop."""
        for key in self.watched:
            if key in row and key not in self.first and _finite(row[key]):
                self.first[key] = float(row[key])
        self.steps += 1
        self.low = self.low + 1 if signal < LOW_SIGNAL else 0
        if signal > 0:
            self.idle, self.last_signal_step, self.checkpoint = 0, row["step"], None
            return None
        self.idle += 1
        if self.stop_after and self.idle >= self.stop_after:
            return self.report(row)
        return None

    def warning(self, row: dict, signal: float) -> str | None:
        """One line when a stretch of steps that mostly carried no signal reaches `warn_after`
        steps (once per stretch: a long stall does not repeat it every few steps), or at the last
        step of a run too short to reach it whose every step lacked signal."""
        if not self.warn_after or not self.low:
            return None
        short = (self.low < self.warn_after and self.low == self.steps and self.last_step
                 and row["step"] >= self.last_step)
        if self.low != self.warn_after and not short:
            return None
        stop = (f"; the run stops after {self.stop_after} steps without any ({self.idle} so far)"
                if self.stop_after and not short else "")
        return (f"warning: {self.low} step(s) in a row had no reward spread in most of the groups trained on "
                f"({1 - signal:.0%} at step {row['step']}): {MEANING}; since step 1: {self.describe(row)}{stop}"
                + (f"; try {self.hint}" if self.hint else ""))

    def changes(self, row: dict) -> list[dict]:
        """Each watched quantity at the first step and now, the collapsed ones first."""
        out = []
        for key in self.watched:
            if key in self.first and key in row and _finite(row[key]):
                start, now = self.first[key], float(row[key])
                collapsed = start > 0 and now <= COLLAPSED * start
                out.append({"metric": key, "start": start, "now": now, "collapsed": collapsed})
        return sorted(out, key=lambda c: not c["collapsed"])

    def describe(self, row: dict) -> str:
        parts = [f"{LABELS.get(c['metric'], c['metric'])} {c['start']:.3g} -> {c['now']:.3g}"
                 + (" (collapsed)" if c["collapsed"] else "") for c in self.changes(row)]
        return ", ".join(parts) or "no watched metric was logged"

    def report(self, row: dict) -> dict:
        reason = (f"no gradient signal for {self.idle} steps in a row (in every group the completions all scored "
                  "the same, so every advantage was 0)" + (f"; try {self.hint}" if self.hint else ""))
        return {"reason": reason, "step": row["step"],
                "last_signal_step": self.last_signal_step, "changes": self.changes(row),
                "collapsed": [c["metric"] for c in self.changes(row) if c["collapsed"]],
                "summary": self.describe(row), "exported_from": self.checkpoint}


def steps_with_signal(rows: list[dict]) -> tuple[int, int, float] | None:
    """(steps with any signal, steps, the mean share of a step's groups with signal) over a
    run's metrics rows, from the `signal_share` a GRPO-family step logs; None for the methods
    that log none (every step of theirs has a gradient)."""
    shares = [float(r["signal_share"]) for r in rows if _finite(r.get("signal_share"))]
    if not shares:
        return None
    return sum(s > 0 for s in shares), len(shares), sum(shares) / len(shares)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)
