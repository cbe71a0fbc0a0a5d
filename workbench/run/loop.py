"""The training loop, and only the loop: data -> step -> log -> evaluate -> checkpoint.

    stalled = loop(runner, guard, watch, results)   # workbench/run/runner.py calls this once

Everything around it is a named service the loop calls: the fault guard (signals, non-finite
steps; workbench/train/faults.py), the stall watch (GRPO steps without gradient;
workbench/train/signal.py), the checkpoints (workbench/run/checkpoints.py), the evaluations
(workbench/run/evaluation.py) and the plan check (workbench/run/finish.py). What happens before
the first step (build, resume, manifest) and after the last (evaluation, export, report) is
workbench/run/runner.py's.
"""

from __future__ import annotations

import os
import time

from workbench.core import heartbeat
from workbench.telemetry.metrics import throughput
from workbench.train import noise


def loop(r, guard, watch, results: dict) -> dict | None:
    """Train from `r.state.step` to `train.max_steps`; the stall watch's verdict if it stopped
    the run early, else None. A preemption signal checkpoints and exits inside (guard)."""
    cfg = r.cfg
    while r.state.step < cfg.train.max_steps:
        crash_if_asked(cfg.debug, r.state.step, r.rank)
        t0 = time.perf_counter()
        heartbeat.step(r.state.step)
        r.memory.before(r.state.step)  # the plan check's memory window (CPU: its own step)
        batch = next_batch(r)                                              # data
        if watch is not None and watch.begins(batch.signal, r.state.step):
            watch.checkpoint = str(r.checkpoints.save(r.state))  # the last weights trained with signal
        r.shapes.update(batch)  # the batch shapes the plan check plans for
        r.memory.seen(batch)
        metrics = guard.step(batch, r.method.loss, r.state.step, r.checkpoints.latest_valid)  # step
        row = r.clock.record(r, batch, metrics, time.perf_counter() - t0)  # log
        r.memory.after(r.state.step)
        r.tracker.log(row, show=r.state.step % cfg.train.log_every == 0 or r.state.step == 1)
        stalled = watch_step(r, watch, row, batch)
        saved = checkpoint_if_due(r, watch)                                # checkpoint
        if guard.stop_requested():  # collective: every rank checkpoints at the same step
            guard.exit_preempted(r.state.step, r.checkpoints.at_step(r.state, saved))
        if cfg.eval.every_n_steps and r.state.step % cfg.eval.every_n_steps == 0:  # evaluate
            results.setdefault("eval_during", []).append({"step": r.state.step, **r.evaluator.evaluate("step")})
        if r.state.step == cfg.plan.check_after_steps:
            results["plan_check"] = r.plan_check()
        if stalled:
            return stalled
    return None


def crash_if_asked(debug, step: int, rank: int) -> None:
    """debug.crash_at_step: die like a killed rank would, on the first attempt only (a torchrun
    restart must get past it); debug.step_sleep_s: a slower step."""
    if debug.step_sleep_s:  # a slow step: time for a test to signal or cut a node mid-run
        time.sleep(debug.step_sleep_s)
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if step == debug.crash_at_step and rank == debug.crash_rank and first_attempt:
        os._exit(17)


def next_batch(r):
    """The method's next batch (GRPO rolls out and scores here), with its dropout seeds."""
    with heartbeat.phase("data"):  # GRPO marks its rollout and reward functions inside
        batch = r.method.next_batch(r.state, r.backend)
    if r.dropout:
        batch.micro_seeds = micro_seeds(r, len(batch.micro))
    return batch


def micro_seeds(r, n: int) -> list[int]:
    """A seed per micro-batch from its first row's global sample index: the same rows get the
    same dropout masks at any world size (workbench/train/noise.py)."""
    b, lay = r.run.batch, r.run.layout
    first = r.state.step * b.size + lay.dp_rank * b.per_rank
    return [noise.key(r.cfg.train.seed, r.state.step, first + i * b.micro) for i in range(n)]


def watch_step(r, watch, row: dict, batch) -> dict | None:
    """The stall watch's verdict on this step (None: keep going), its warning on the console."""
    if watch is None:
        return None
    stalled = watch.after(row, batch.signal)
    line = watch.warning(row, batch.signal)
    if line:
        r.tracker.console(line)
    return stalled


def checkpoint_if_due(r, watch) -> bool:
    """Every train.checkpoint_every steps, but not the last (the runner saves it) and not during
    a stall: those weights have no signal and would rotate out the one the stall began with."""
    every = r.cfg.train.checkpoint_every
    due = (every and r.state.step % every == 0 and r.state.step < r.cfg.train.max_steps
           and not (watch is not None and watch.idle))
    if due:
        r.checkpoints.save(r.state)
    return bool(due)


class Clock:
    """The counters a step advances and the metrics.jsonl row it writes."""

    def __init__(self, run, flop_count, peak: float, t_launch: float):
        self.run, self.flops, self.peak, self.t_launch = run, flop_count, peak, t_launch
        self.losses: list[float] = []
        self.first_step_at: float | None = None

    def record(self, r, batch, metrics: dict, dt: float) -> dict:
        r.dog.step_time(dt)
        self.first_step_at = self.first_step_at or (time.perf_counter() - self.t_launch)
        r.state.step += 1
        # data-parallel ranks each see different tokens; tensor/pipeline peers share theirs
        dp = self.run.layout.dp
        r.state.tokens_seen += batch.tokens * dp
        r.state.samples_seen += self.run.batch.size
        loss = metrics.pop("loss")
        self.losses.append(loss)
        return {"step": r.state.step, "loss": loss, **metrics, **batch.info, "tokens": batch.tokens * dp,
                "tokens_per_s": batch.tokens * dp / dt, "step_seconds": dt, "time": time.time(),
                **throughput(self.flops, batch, dt, self.peak, dp)}
