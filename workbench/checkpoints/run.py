"""A run's checkpoints as the runner uses them: where it resumes, what a save writes, which
weights go back in (the best, a stall's last good step), and what is kept when an eval hook fails.

    ckpts = Checkpoints(run, run_dir, backend, method, identity, tracker)   # the backend holds the model
    path, state = ckpts.resume(state)    # None, state: nothing to resume
    ckpts.save(state)

The format, its verification and rotation are workbench/checkpoints/checkpoint.py's; resuming at
another layout is workbench/checkpoints/resume.py's; the certificate is workbench/checkpoints/replay.py's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch.distributed as dist

from workbench.checkpoints import canonical, checkpoint, keep_best, replay, resume, resume_changes
from workbench.core import heartbeat
from workbench.core.errors import UserError
from workbench.train import noise
from workbench.train.state import TrainState, rng_state, seed_everything, set_rng_state


class Checkpoints:
    def __init__(self, run, run_dir: Path, backend, method, identity: dict, tracker):
        """`run`: the resolved run (its config, layout and device); `identity`: what a checkpoint
        must match to be resumed (workbench/checkpoints/resume.py); `tracker`: the save's status line."""
        self.cfg, self.run, self.run_dir = run.cfg, run, run_dir
        self.rank, self.world, self.is_main = run.layout.rank, run.layout.world, run.layout.is_main
        self.backend, self.method, self.device = backend, method, run.device
        self.identity = identity
        self.tracker = tracker
        self.resumed: dict | None = None  # where the run resumed from, its certificate
        self.resumed_step = 0  # the step the run continued from (0: a fresh start)
        self.changes = resume_changes.Changes()  # settings the resume changed (workbench/checkpoints/resume_changes.py)
        # the run's launches so far, each from its first step: what it resumed from and what it
        # changed; every checkpoint carries it, so the report of a chained resume covers them all
        self.history: list[dict] = [{"first_step": 1, "resumed_from": None}]

    def latest_valid(self):
        return checkpoint.latest_valid(self.run_dir)

    # -- resume ------------------------------------------------------------------------------
    def resume(self, state: TrainState) -> tuple[str | None, TrainState]:
        """Load the checkpoint train.resume points at, if any: (its path, the state it holds)."""
        # resume_point verifies each checkpoint's files and falls back past a damaged one
        path = checkpoint.resume_point(self.run_dir, self.cfg.train.resume)
        self.resumed, self.resumed_step = None, 0
        self.history = [{"first_step": 1, "resumed_from": None}]
        if path is None:
            return None, state
        path_, state = self._load(path, state)
        self.resumed_step = state.step
        if self.is_main:
            print(f"resuming from step {state.step} ({path})", file=sys.stderr, flush=True)
            line = resume_changes.say(self.changes, int(self.cfg.train.max_steps))
            if line:
                print(line, file=sys.stderr, flush=True)
        return path_, state

    def _load(self, path: Path, state: TrainState) -> tuple[str, TrainState]:
        if checkpoint.is_legacy(path):  # from before the canonical format: only at its own layout
            resume.check_legacy({"format": "legacy", "name": path.name, "layout": checkpoint.legacy_layout(path)},
                                self.cfg, self.world)
            self.backend.load_legacy(path, self.rank)
            meta = checkpoint.legacy_meta(path, self.rank)
            self.method.load_state_dict(meta["method"])
            set_rng_state(meta["rng"])
            return str(path), TrainState(**meta["train_state"])
        rec, here = checkpoint.record(path), resume.layout_of(self.cfg, self.run)
        if self.cfg.train.keep_global_batch and rec["global_batch"] != self.run.batch.size:
            raise UserError(f"{path.name} has global batch {rec['global_batch']}, this run {self.run.batch.size}; "
                            "resume it with its own train.micro_batch_size, or train.keep_global_batch=false")
        self.backend.load_canonical(canonical.reader(path / checkpoint.CANONICAL, where=path.name))
        self.backend.load_schedule(rec["schedule"])
        self.method.load_state_dict(rec["method"])
        state = TrainState(**rec["train_state"])
        written = rec["layout"]
        same = all(written.get(k) == here[k] for k in ("backend", "world", "tp", "pp", "stage"))
        saved_rng = checkpoint.rng(path, self.rank) if same else None
        if saved_rng is not None:
            set_rng_state(saved_rng)
        else:  # another layout: each rank's generator starts from (seed, step, rank)
            seed_everything(noise.key(self.cfg.train.seed, state.step, self.rank) % (1 << 32))
        # rollouts generated before the checkpoint (GRPO's): per rank and in its micro-batches, so only
        # at the layout and batch split that wrote them
        split = (written["micro"], written["accum"], written["dp"]) == (self.run.batch.micro, self.run.batch.accum,
                                                                         self.run.batch.dp)
        self.method.load_rollouts(checkpoint.rollouts(path, self.rank) if same and split else None)
        cert = replay.certificate(rec["probe"], replay.probe_loss_of(self.backend, rec["probe"], self.device),
                                  resume.describe(written), resume.describe(here),
                                  (written["precision"], here["precision"]))
        rl = self.method.resume_facts({"step": state.step, "generator_sha256": checkpoint.rng_digest(path, self.rank),
                                       "generator": "restored" if saved_rng is not None else
                                       f"re-seeded from (train.seed, step {state.step}, rank {self.rank})"})
        if rl:  # a generating method's state beyond the weights
            cert["rl"] = rl
        b = self.run.batch
        # a change to what a step computes was refused before weights loaded unless allowed (runner.build)
        self.changes = resume_changes.compare({**rec, "name": path.name}, self.cfg)
        changed = self.changes.to_dict()
        # a checkpoint from before the history was kept: one launch up to it
        self.history = [*(rec.get("history") or [{"first_step": 1, "resumed_from": None}]),
                        {"first_step": state.step + 1, "resumed_from": path.name, "result": changed["result"],
                         "other": changed["other"]}]
        self.resumed = {"from": str(path), "certificate": cert, "changes": changed, "history": self.history, "batch": (
            f"global batch {b.size} = {b.micro} x {b.accum} x {b.dp} data-parallel (written as {written['micro']} x "
            f"{written['accum']} x {written['dp']}), {state.samples_seen} samples seen, RNG "
            + ("restored" if saved_rng is not None else "re-seeded for the new layout"))}
        if self.is_main and (not same or (written["micro"], written["accum"], written["dp"]) != (b.micro, b.accum, b.dp)):
            print(f"resuming {path.name} written by {cert['from']} under {cert['to']}: {self.resumed['batch']}; "
                  f"certificate {'ok' if cert['ok'] else 'FAILED'} (rel diff {cert['rel_diff']:.1e}, "
                  f"tolerance {cert['tolerance']:.0e})", file=sys.stderr, flush=True)
        return str(path), state

    # -- save --------------------------------------------------------------------------------
    def boundary(self) -> tuple[dict, dict]:
        """What a checkpoint written now would hold beside the weights: the method's state (the
        data position) and every RNG, copied, so a save later in the step can be made as of this
        step boundary (keep_after_failed_service)."""
        return copy.deepcopy(self.method.state_dict()), rng_state()

    def save(self, state: TrainState, boundary: tuple[dict, dict] | None = None) -> Path:
        """The weights, the optimizer and `state`; the method's state and the RNGs as they are, or
        as `boundary()` took them (the weights have not changed since)."""
        method_state, rngs = boundary or (self.method.state_dict(), rng_state())
        # rollouts already generated for the next steps; none for a save as of an earlier boundary
        rollouts = self.method.rollouts_state() if boundary is None else None
        with heartbeat.phase("checkpoint"):
            spec = replay.probe_spec(self.cfg)
            probe = replay.probe_loss_of(self.backend, spec, self.device)  # the weights being saved (collective)
            record = {"format": canonical.FORMAT, "step": state.step, "samples_seen": state.samples_seen,
                      "global_batch": self.run.batch.size, "train_state": state.to_dict(),
                      "layout": resume.layout_of(self.cfg, self.run), "method": method_state,
                      "schedule": self.backend.schedule_state(), "identity": self.identity,
                      "settings": resume_changes.settings(self.cfg),  # what a resume compares against
                      "history": self.history,  # which steps ran in which launch, under which changes
                      "probe": {**spec, "loss": probe}}
            barrier = dist.barrier if dist.is_initialized() else (lambda: None)
            with self.tracker.progress.status(f"checkpoint step {state.step}"):
                return checkpoint.save(self.run_dir, state.step, self.backend.save_canonical, record, rngs,
                                       self.rank, keep=self.cfg.train.keep_checkpoints, barrier=barrier,
                                       rollouts=rollouts)

    def at_step(self, state: TrainState, saved: bool) -> Path:
        """This step's checkpoint, written now unless it already was, and committed (a preemption
        exits right after)."""
        path = checkpoint.ckpt_root(self.run_dir) / f"step-{state.step:08d}" if saved else self.save(state)
        checkpoint.flush()
        return path

    # -- weights back in ---------------------------------------------------------------------
    def load_weights(self, path) -> None:
        """Put a saved checkpoint's weights (and optimizer) back into the backend."""
        path = Path(path)
        if checkpoint.is_legacy(path):
            self.backend.load_legacy(path, self.rank)
        else:
            self.backend.load_canonical(canonical.reader(path / checkpoint.CANONICAL, where=path.name))

    def load_best(self) -> str:
        """train.export_best: put the best evaluated checkpoint's weights back before the export."""
        path = keep_best.best_dir(self.run_dir)
        if path is None:
            self.tracker.console("train.export_best: no best checkpoint was kept; exporting the last weights")
            return "last"
        self.load_weights(path)
        return str(path)

    def keep_after_failed_service(self, state: TrainState, boundary: tuple[dict, dict] | None) -> str:
        """After a reward service failed mid-step: the steps trained so far on disk, saved as of the
        step's start (`boundary`: the data position and RNGs before the rollout drew from them;
        one process only, since with several a save is a collective a failing rank may not
        reach), and where a relaunch resumes from."""
        if state.step and boundary is not None and self.world == 1:
            self._save_unless_saved(state, boundary)
        latest = checkpoint.latest(self.run_dir)
        if latest is None:
            return "no step was trained yet"
        return (f"checkpoint {latest} is kept; relaunch with the same output_dir once the service answers "
                "(train.resume=auto continues from it)")

    def keep_after_failed_hook(self, tag: str, state: TrainState) -> str:
        """After an eval hook failed: make sure the trained weights so far are on disk, and say where."""
        if tag == "start":
            return "nothing was trained yet"
        if tag == "step" and self.world == 1:  # a checkpoint of the step the hook failed at (no peers to wait for)
            self._save_unless_saved(state)
        return f"the run's checkpoint is kept: {checkpoint.latest(self.run_dir)}"

    def _save_unless_saved(self, state: TrainState, boundary: tuple[dict, dict] | None = None) -> None:
        """This step's checkpoint on disk and committed, written now unless the latest one is it."""
        latest = checkpoint.latest(self.run_dir)
        if latest is None or not str(latest).endswith(f"{state.step:08d}"):
            self.save(state, boundary)
        checkpoint.flush()
