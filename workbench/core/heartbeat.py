"""What this process is doing right now: its phase and step, for the watchdog.

The training loop, the backends, the methods and the reward and evaluation code mark their
phases; workbench/guard/watchdog.py reads the mark from its own thread, publishes it to the
other ranks and judges whether the run still makes progress. Marking costs two attribute
writes and a clock read, so it sits on every step's path.

    from workbench.core import heartbeat
    with heartbeat.phase("forward"):
        loss = model(batch)
    heartbeat.step(12)

Fault injection for the watchdog's tests: `debug.hang_phase=forward debug.hang_at_step=2
debug.hang_rank=1` makes rank 1 sleep when it enters that phase at that step (0-based, like
`debug.crash_at_step`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

# phases whose budget is the long one (workbench/guard/watchdog.py): they take as long as they
# take, once, and are not a step's work
LONG_PHASES = ("startup", "evaluation", "checkpoint", "export")


@dataclass
class Beat:
    phase: str = "startup"
    detail: str = ""  # e.g. the reward function's module:function
    step: int = 0
    since: float = 0.0  # time.time() when the phase or step last changed: the last sign of progress
    hang: tuple | None = None  # (phase, step) at which to sleep (debug.hang_*)


BEAT = Beat(since=time.time())


def step(n: int) -> None:
    """The step the loop is on, as its count of finished optimizer steps (0 during the first);
    between the marked phases of a step the phase reads `step`."""
    BEAT.phase, BEAT.detail, BEAT.step, BEAT.since = "step", "", n, time.time()


@contextlib.contextmanager
def phase(name: str, detail: str = ""):
    """Mark `name` as this process's phase while the block runs; the previous one after. A block
    that raises leaves its phase marked: the error is reported where it happened."""
    before = (BEAT.phase, BEAT.detail)
    BEAT.phase, BEAT.detail, BEAT.since = name, detail, time.time()
    if BEAT.hang is not None and BEAT.hang == (name, BEAT.step):
        time.sleep(10**7)  # debug.hang_*: a stuck rank for the watchdog's tests
    yield
    BEAT.phase, BEAT.detail, BEAT.since = *before, time.time()


def describe(phase_: str, detail: str, step_: int) -> str:
    """`forward at step 3` (1-based, as the logs count steps), `startup`, `reward function (m:f) at step 1`."""
    name = f"{phase_}{f' ({detail})' if detail else ''}"
    return name if phase_ == "startup" else f"{name} at step {step_ + 1}"


def where() -> str:
    return describe(BEAT.phase, BEAT.detail, BEAT.step)
