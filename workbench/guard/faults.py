"""Faults the training loop survives: preemption signals and non-finite numbers.

Preemption. SIGTERM (spot reclaim; Slurm, Modal, RunPod, Ray and Kubernetes stops) and SIGINT
(Ctrl-C) do not kill the run: the current optimizer step finishes, a checkpoint is written and
the process exits with status `PREEMPTED_EXIT` (75, EX_TEMPFAIL: "try again"). Relaunching with
the same `output_dir` (`train.resume=auto`; Slurm's requeue, Ray's and torchrun's restarts do
this) continues with the same per-step losses as an uninterrupted run. A second signal exits at
once with 128 + the signal number (143 SIGTERM, 130 SIGINT), leaving the last complete
checkpoint. Under several ranks every rank learns of a signal any rank received at the same
step, so they checkpoint together.

Numerical faults. A NaN or Inf loss, or a non-finite gradient, found after backward and before
the optimizer step, skips that step (gradients dropped, weights and optimizer untouched; the
step still consumes its data and counts as `bad_step` in metrics.jsonl) while at most
`train.max_bad_steps` such steps have happened; one more stops the run with `NumericalFault`
naming the last good checkpoint. Default 0: the first one stops. Backends whose gradients the
loop cannot see before the step (deepspeed, megatron) stop instead of skipping when the grad
norm comes back non-finite. fp16 (a loss scaler) is left to the scaler, which skips overflowed
steps itself. `debug.nan_at_step=N` multiplies step N's loss (0-based, like
`debug.crash_at_step`) by NaN to test this.

    python -m workbench model=tiny precision=fp32 debug.nan_at_step=3 train.max_bad_steps=1
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading

from workbench.checkpoints import checkpoint
from workbench.core.errors import UserError
from workbench.train.distributed import any_rank

PREEMPTED_EXIT = 75  # checkpoint written; relaunch to continue (EX_TEMPFAIL)
# What a launcher does once the preemption checkpoint is written, before the exit (Slurm: requeue
# the job, workbench/launch/slurm.py); each is called with (step, checkpoint).
ON_PREEMPTED: list = []
# What a launcher does when a peer rank is lost (its node gone) and this rank stops with it (Slurm:
# requeue the job, which resumes from the last checkpoint once its nodes answer again); each is
# called with the lost ranks.
ON_PEER_LOST: list = []


class NumericalFault(UserError):
    """More non-finite steps than train.max_bad_steps (or weights no longer finite)."""


def check_config(cfg) -> None:
    """What this module and checkpoint.py rely on, refused before anything loads: the fault and
    checkpoint settings, an explicit `train.resume` checkpoint, and an `output_dir` that can
    hold a run."""
    from pathlib import Path


    for key in ("max_bad_steps", "checkpoint_every", "keep_checkpoints", "stall_steps"):
        if cfg.train[key] < 0:
            raise UserError(f"train.{key}={cfg.train[key]} must be >= 0")
    if cfg.train.resume not in ("auto", "never"):
        checkpoint.resume_point(cfg.output_dir, cfg.train.resume)  # verifies it, or says why not
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"output_dir={out} is a file, not a directory")
    parent = next((p for p in (out, *out.parents) if p.exists()), None)
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output_dir={out}: {parent} is not writable")


class Guard:
    """One per run: installs the signal handlers, checks each step's numbers."""

    def __init__(self, run, backend, say=print):
        cfg = run.cfg
        self.backend = backend
        self.device = run.device
        self.say = say
        self.max_bad = cfg.train.max_bad_steps
        self.nan_at = cfg.debug.nan_at_step
        self.bad_steps = 0
        self.signal: int | None = None
        self._previous: dict = {}
        # fp16: the loss scaler owns overflow handling (it skips steps whose gradients overflow)
        self.scaled = run.precision.loss_scaling
        self.can_skip = backend.skips_steps

    # -- signals -------------------------------------------------------------------------
    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. not in a Ray actor thread)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:  # a second signal: stop now
            print(f"{name} again: exiting at once (the last complete checkpoint stays)", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.signal = signum
        print(f"{name}: finishing this step, writing a checkpoint, then exiting with status {PREEMPTED_EXIT} "
              f"(send it again to exit at once)", file=sys.stderr, flush=True)
        previous = self._previous.get(signum)
        # A launcher's own handler (e.g. submitit's SIGTERM logger) still runs; Python's default
        # SIGINT handler would raise KeyboardInterrupt mid-step, so it does not.
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)

    def stop_requested(self) -> bool:
        """Collective under several ranks: whether any rank was signalled."""
        return any_rank(self.signal is not None, self.device)

    def exit_preempted(self, step: int, ckpt) -> None:
        self.uninstall()
        print(f"preempted at step {step}: checkpoint {ckpt}; relaunch with the same output_dir to continue",
              file=sys.stderr, flush=True)
        for then in ON_PREEMPTED:
            then(step, ckpt)
        raise SystemExit(PREEMPTED_EXIT)

    # -- numbers -------------------------------------------------------------------------
    def loss_fn(self, loss_fn, step: int):
        """The method's loss, poisoned with NaN at `debug.nan_at_step` (fault injection)."""
        if step != self.nan_at:
            return loss_fn

        def poisoned(model, micro):
            loss, metrics = loss_fn(model, micro)
            return loss * float("nan"), metrics

        return poisoned

    def judge(self, m: dict, step: int, last_good) -> str | None:
        """Between backward and the update (workbench/run/loop.py step): why this step's update
        must not happen (a non-finite loss or gradient on any rank), or None. A refused step is
        skipped, or the run stops naming `last_good()`, the last good checkpoint. Under fp16 the
        loss scaler owns overflow: it skips such steps itself."""
        if self.scaled:
            return None
        bad = not math.isfinite(m["loss"])
        if self.can_skip and not bad:
            bad = not self.backend.gradients_finite()
        if not any_rank(bad, self.device):  # every rank skips (or stops) together
            return None
        why = f"loss={m['loss']}" if not math.isfinite(m["loss"]) else "non-finite gradients"
        if not self.can_skip:
            self.bad_steps += 1
            self._stop(step, f"{why} on backend {self.backend.name}, which cannot skip a step", last_good)
        self._count(step, why, last_good)
        return why

    def check_applied(self, m: dict, step: int, last_good) -> None:
        """After the update: a gradient that was not finite yet was not caught before it leaves
        the weights suspect, and the run stops."""
        if not m.get("bad_step") and not math.isfinite(m.get("grad_norm", 0.0)):
            self._stop(step, f"grad_norm={m['grad_norm']} after the optimizer step", last_good)

    def _count(self, step: int, why: str, last_good) -> None:
        self.bad_steps += 1
        if self.bad_steps > self.max_bad:
            self._stop(step, why, last_good)
        self.say(f"warning: step {step + 1}: {why}; skipped ({self.bad_steps} of at most "
                 f"{self.max_bad} bad steps, train.max_bad_steps)")

    def _stop(self, step: int, why: str, last_good) -> None:
        self.uninstall()
        ckpt = last_good()
        where = f"the last good checkpoint is {ckpt}" if ckpt else "no checkpoint was written yet"
        raise NumericalFault(f"step {step + 1}: {why}; stopped after {self.bad_steps} bad step(s) "
                             f"(train.max_bad_steps={self.max_bad}); {where}; lower optim.lr, check the data, "
                             f"or raise train.max_bad_steps to skip such steps")
