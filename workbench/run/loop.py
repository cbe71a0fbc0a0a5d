"""The training loop, and only the loop: data -> step -> log -> evaluate -> checkpoint.

    stalled = loop(parts, guard, watch, results)   # workbench/run/runner.py calls this once

The loop works with the `Parts` the runner hands it, each named for what it does: the method
(data and loss), the backend (the model), the train state and its clock, the tracker, the
checkpoints (workbench/checkpoints/run.py), the evaluations (workbench/evals/evaluator.py) and
the plan check's probes (workbench/plan/check.py). Around the step are the fault guard
(signals, non-finite steps; workbench/guard/faults.py), which judges each step between its
backward and its update, and the
stall watch (GRPO steps without gradient; workbench/train/signal.py) and the loss watch (a
supervised loss that stopped falling; workbench/telemetry/stall.py). What happens before the
first step (build, resume, manifest) and after the last (evaluation, export, report) is
workbench/run/runner.py's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from workbench.checkpoints.run import Checkpoints
from workbench.core import heartbeat
from workbench.envs.openenv import EnvServerError
from workbench.evals.evaluator import Evaluator
from workbench.plan.check import Memory, Shapes
from workbench.resolve.derive import Run
from workbench.rollout.remote import RewardServiceError
from workbench.telemetry.metrics import Tracker, throughput
from workbench.telemetry.stall import LossWatch, watch_loss
from workbench.train import noise
from workbench.train.state import TrainState


@dataclass
class Parts:
    """What the loop works with; the runner builds it once the run has resumed."""

    run: Run
    state: TrainState
    method: object  # workbench/methods/base.py Method: next_batch, loss
    backend: object  # workbench/backends/base.py Backend
    clock: Clock
    tracker: Tracker
    checkpoints: Checkpoints
    evaluator: Evaluator
    shapes: Shapes  # the batch shapes the plan check plans for
    memory: Memory  # the plan check's memory window
    plan_check: Callable[[], dict | None]  # at plan.check_after_steps (workbench/run/finish.py)
    dropout: bool  # the model draws dropout masks, keyed by each micro-batch's samples


def loop(p: Parts, guard, watch, results: dict) -> dict | None:
    """Train from `p.state.step` to `train.max_steps`; the stall watch's verdict if it stopped
    the run early, else None. A preemption signal checkpoints and exits inside (guard)."""
    cfg, state = p.run.cfg, p.state
    # a generating method's step may fail in its rollout (a reward service gone): what a checkpoint
    # at the step's start would hold, to save the steps trained so far (one process)
    keep = p.run.facts.generates and p.run.layout.world == 1
    boundary = p.checkpoints.boundary() if keep else None
    losses = LossWatch.of(p.run)  # a supervised run whose loss stops falling says so (train.stall_steps)
    while state.step < cfg.train.max_steps:
        crash_if_asked(cfg.debug, state.step, p.run.layout.rank)
        t0 = time.perf_counter()
        heartbeat.step(state.step)
        p.memory.before(state.step)  # the plan check's memory window (CPU: its own step)
        batch = next_batch_or_keep(p, boundary)                            # data
        if watch is not None and watch.begins(batch.signal, state.step):
            watch.checkpoint = str(p.checkpoints.save(state))  # the last weights trained with signal
        p.shapes.update(batch)
        p.memory.seen(batch)
        metrics = step(p.backend, batch, guard.loss_fn(p.method.loss, state.step),        # step
                       lambda m: guard.judge(m, state.step, p.checkpoints.latest_valid))
        guard.check_applied(metrics, state.step, p.checkpoints.latest_valid)
        advance(state, p.run, batch)
        row = p.clock.record(state, batch, metrics, time.perf_counter() - t0)  # log
        p.memory.after(state.step)
        p.tracker.log(row, show=state.step % cfg.train.log_every == 0 or state.step == 1)
        stalled = watch_step(p.tracker, watch, row, batch)
        watch_loss(losses, row, p.tracker.console, results)
        saved = checkpoint_if_due(p, watch)                                # checkpoint
        boundary = p.checkpoints.boundary() if keep else None
        if guard.stop_requested():  # collective: every rank checkpoints at the same step
            guard.exit_preempted(state.step, p.checkpoints.at_step(state, saved))
        if cfg.eval.every_n_steps and state.step % cfg.eval.every_n_steps == 0:  # evaluate
            results.setdefault("eval_during", []).append({"step": state.step, **p.evaluator.evaluate("step", state)})
        if state.step == cfg.plan.check_after_steps:
            results["plan_check"] = p.plan_check()
        if stalled:
            return stalled
    return None


def step(backend, batch, loss_fn, refuse: Callable[[dict], str | None]) -> dict:
    """One optimizer step on the Backend protocol (workbench/backends/base.py): forward and
    backward over the step's micro-batches, then the update unless `refuse(metrics)` says why
    not (the fault guard's judgement), in which case the gradients are dropped, the weights
    untouched and `bad_step` is 1."""
    with heartbeat.phase("forward"):  # backends mark forward and backward inside (backends/step.py)
        metrics = backend.forward_backward(batch, loss_fn)
    if refuse(metrics) is not None:
        metrics.update(backend.discard_gradients(), bad_step=1)
        return metrics
    with heartbeat.phase("optimizer"):
        metrics.update(backend.optimizer_step())
    return metrics


def crash_if_asked(debug, step: int, rank: int) -> None:
    """debug.crash_at_step: die like a killed rank would, on the first attempt only (a torchrun
    restart must get past it); debug.step_sleep_s: a slower step."""
    if debug.step_sleep_s:  # a slow step: time for a test to signal or cut a node mid-run
        time.sleep(debug.step_sleep_s)
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if step == debug.crash_at_step and rank == debug.crash_rank and first_attempt:
        os._exit(17)


def next_batch_or_keep(p: Parts, boundary: tuple | None):
    """next_batch; where a reward service fails for good (its retries spent), the steps trained
    so far are checkpointed first, as of this step's start (`boundary`; one process: with several
    the last periodic checkpoint stands), and the error says where to resume from."""
    try:
        return next_batch(p)
    except (RewardServiceError, EnvServerError) as exc:  # a reward service, or an environment server (env=openenv)
        raise type(exc)(f"{exc}; {p.checkpoints.keep_after_failed_service(p.state, boundary)}") from exc


def next_batch(p: Parts):
    """The method's next batch (GRPO rolls out and scores here), with its dropout seeds."""
    with heartbeat.phase("data"):  # GRPO marks its rollout and reward functions inside
        batch = p.method.next_batch(p.state, p.backend)
    if p.dropout:
        batch.micro_seeds = micro_seeds(p.run, p.state, len(batch.micro))
    return batch


def micro_seeds(run: Run, state: TrainState, n: int) -> list[int]:
    """A seed per micro-batch from its first row's global sample index: the same rows get the
    same dropout masks at any world size (workbench/train/noise.py)."""
    b, lay = run.batch, run.layout
    first = state.step * b.size + lay.dp_rank * b.per_rank
    return [noise.key(run.cfg.train.seed, state.step, first + i * b.micro) for i in range(n)]


def advance(state: TrainState, run: Run, batch) -> None:
    """The step is done: the counters move (data-parallel ranks each see different tokens;
    tensor/pipeline peers share theirs)."""
    state.step += 1
    state.tokens_seen += batch.tokens * run.layout.dp
    state.samples_seen += run.batch.size


def watch_step(tracker: Tracker, watch, row: dict, batch) -> dict | None:
    """The stall watch's verdict on this step (None: keep going), its warning on the console."""
    if watch is None:
        return None
    stalled = watch.after(row, batch.signal)
    line = watch.warning(row, batch.signal)
    if line:
        tracker.console(line)
    return stalled


def checkpoint_if_due(p: Parts, watch) -> bool:
    """Every train.checkpoint_every steps, but not the last (the runner saves it) and not during
    a stall: those weights have no signal and would rotate out the one the stall began with."""
    train, step = p.run.cfg.train, p.state.step
    due = (train.checkpoint_every and step % train.checkpoint_every == 0 and step < train.max_steps
           and not (watch is not None and watch.idle))
    if due:
        p.checkpoints.save(p.state)
    return bool(due)


class Clock:
    """Times the steps and writes each step's metrics.jsonl row; `on_step`: told each step's
    seconds (the watchdog's stall budget follows them)."""

    def __init__(self, run: Run, flop_count, peak: float, t_launch: float, on_step: Callable[[float], None]):
        self.run, self.flops, self.peak, self.t_launch, self.on_step = run, flop_count, peak, t_launch, on_step
        self.losses: list[float] = []
        self.first_step_at: float | None = None

    def record(self, state: TrainState, batch, metrics: dict, dt: float) -> dict:
        self.on_step(dt)
        self.first_step_at = self.first_step_at or (time.perf_counter() - self.t_launch)
        dp = self.run.layout.dp
        loss = metrics.pop("loss")
        self.losses.append(loss)
        return {"step": state.step, "loss": loss, **metrics, **batch.info, "tokens": batch.tokens * dp,
                "tokens_per_s": batch.tokens * dp / dt, "step_seconds": dt, "time": time.time(),
                **throughput(self.flops, batch, dt, self.peak, dp)}
