"""The run from start to end: build, resume, the loop, evaluate, export, report.

    results = Runner(cfg).train()     # cfg from workbench/resolve/validate.py

    build     tokenizer and data read and checked, then the model, adapters, precision, backend
    start     tracker, resume (workbench/checkpoints/run.py), manifest, the evaluation at start
    loop      data -> step -> log -> evaluate -> checkpoint (workbench/run/loop.py)
    finish    the last checkpoint, the evaluation at end, export and report (workbench/run/finish.py)

Order of work is chosen so mistakes surface early: tokenizer and data are read and checked
before any weights load, then the model, adapters and precision, then resume, then the loop.
Rank 0 writes logs, checkpoint pointers, the export and the report. The resolved run
(workbench/resolve/resolved.py) goes by one name everywhere: `run` (`runner.run`, `ctx.run`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from workbench.backends import registry as backends
from workbench.checkpoints import checkpoint, replay, resume, resume_changes
from workbench.checkpoints.run import Checkpoints
from workbench.compute import precision
from workbench.compute.flops import FlopCount
from workbench.core import heartbeat, startup
from workbench.core.secrets import secret_values
from workbench.evals.evaluator import Evaluator
from workbench.guard import faults
from workbench.guard.watchdog import Watchdog, gpu_env
from workbench.methods import registry as methods
from workbench.models import unsloth_loader
from workbench.models.build import build_model
from workbench.models.head import SelectiveLM
from workbench.plan import check as plan_check
from workbench.plan.peak import peak_flops
from workbench.resolve.derive import Run
from workbench.resolve.resolved import resolve_run
from workbench.run import finish, fresh
from workbench.run.loop import Clock, Parts, loop
from workbench.run.preflight import tokenizer as make_tokenizer
from workbench.telemetry.metrics import Tracker
from workbench.train.context import Context
from workbench.train.distributed import init_distributed, launched_here
from workbench.train.state import TrainState, seed_everything


class Runner:
    def __init__(self, cfg: DictConfig, run: Run | None = None, tokenizer: tuple | None = None):
        """`run`, `tokenizer`: the resolved run and the (tokenizer, chat contract) preflight made in
        this process, if any (else made here)."""
        self.run_dir = Path(cfg.output_dir)
        self.device = cfg.hardware.device
        if cfg.hardware.threads:
            torch.set_num_threads(cfg.hardware.threads)
        for key, value in (cfg.hardware.env or {}).items():  # NCCL presets, also under the user's own torchrun
            os.environ.setdefault(str(key), str(value))
        if self.device == "cuda":  # NCCL's own watchdog and flight recorder (workbench/guard/watchdog.py)
            for key, value in gpu_env(self.run_dir).items():
                os.environ.setdefault(key, value)
        self.rank, self.world = init_distributed(self.device, cfg.hardware.timeout_minutes)
        self.is_main = self.rank == 0
        if run is None or (run.layout.rank, run.layout.world) != (self.rank, self.world):
            run = resolve_run(cfg, self.rank, self.world)  # the rule table runs here too
        self.run = run
        self.cfg = run.cfg  # a resume at another world size changes train.grad_accum (resolve/resolved.py)
        self.pol = run.precision
        self.backend = None  # build() sets model, method, backend
        self._tokenizer = tokenizer
        self.secrets = secret_values(self.cfg)  # values of secret-looking keys, scrubbed from what the run writes
        seed_everything(self.cfg.train.seed)

    # -- build -------------------------------------------------------------------------------
    def build(self) -> None:
        cfg = self.cfg
        self.tokenizer, self.contract = self._tokenizer or make_tokenizer(cfg)
        # a checkpoint of another model, adapter or tokenizer is refused before any weights load
        self.identity = resume.identity(cfg, self.run, self.tokenizer, self.contract)
        rec = resume.record_of(self.run_dir, cfg.train.resume)
        resume.check_identity(rec, self.identity)
        resume_changes.check(rec, cfg)  # a changed lr, data, model, ... refused unless train.resume_changes=allow
        self.ctx = Context(self.run, self.tokenizer, self.contract, self.run_dir)
        self.method = methods.spec(cfg.method.name).build(cfg.method, self.ctx)
        self.method.prepare(self.ctx)  # data errors surface here, before any weights load
        torch.manual_seed(cfg.train.seed)
        self.model = self._load_model()
        self.train_module = SelectiveLM(self.model, chunk=self.run.loss_chunk)  # model.loss_chunk, or chosen
        if cfg.train.compile:
            self.train_module.compile()
        self.backend = backends.spec(cfg.backend.name).build(cfg.backend, self.ctx)
        self.backend.wrap(self.train_module, self.ctx)
        self.method.attach(self.backend)  # e.g. DPO's reference log-probs, once the backend holds the model
        self.state = TrainState()
        # dropout draws its masks keyed by the micro-batch's global samples (workbench/train/noise.py)
        self.dropout = (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())
                        or float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0) > 0)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _load_model(self):
        if self.cfg.model.loader == "unsloth":  # unsloth loads and patches LoRA/QLoRA itself

            model = unsloth_loader.load(self.run, self.run_dir)
            precision.cast_params(model, self.pol)
            if self.pol.fp8:
                precision.apply_fp8(model, self.pol)
            return model
        return build_model(self.run)

    # -- the run -----------------------------------------------------------------------------
    def train(self) -> dict:
        """Train, evaluate, export and report, with the watchdog on (workbench/guard/watchdog.py):
        an error here reaches the other ranks at once, a stall anywhere ends the run with stacks."""
        cfg = self.cfg
        if cfg.train.resume == "never":  # a fresh start is fresh: an earlier run here is moved aside first
            self._start_fresh()
        self.dog = Watchdog(self.run_dir, self.rank, self.world, cfg.hardware.stall_timeout_s, cfg.eval.timeout_s,
                            last_checkpoint=lambda: checkpoint.latest_valid(self.run_dir), secrets=self.secrets)
        if cfg.debug.hang_phase and self.rank == cfg.debug.hang_rank:
            heartbeat.BEAT.hang = (cfg.debug.hang_phase, cfg.debug.hang_at_step)
        if cfg.hardware.watchdog:
            self.dog.start()
        try:
            return self._train()
        except BaseException as exc:
            # a collective that failed because a peer is gone names the peer (workbench/guard/watchdog.py)
            blamed = self.dog.blame(exc) if isinstance(exc, (RuntimeError, dist.DistBackendError)) else exc
            self.dog.fail(blamed)  # the other ranks stop now
            if blamed is not exc:
                if getattr(blamed, "ranks", ()):  # a peer lost: the launcher's say (Slurm requeues)
                    for then in faults.ON_PEER_LOST:
                        then(blamed.ranks, self.rank)
                raise blamed from exc
            raise
        finally:
            self.dog.stop()

    def _start_fresh(self) -> None:
        """train.resume=never: rank 0 moves an earlier run out of output_dir (workbench/run/fresh.py)
        before anything of this one is written there; the other ranks wait for it."""
        if self.is_main:
            moved = fresh.set_aside(self.run_dir, launched=launched_here())
            if moved is not None:
                print(fresh.line(self.run_dir, moved), file=sys.stderr, flush=True)
        if dist.is_initialized():
            dist.barrier()

    def _train(self) -> dict:
        # the job's start: `python -m workbench`'s, so the conversion and preflight before the runner count
        started = startup.started() or time.time()
        t_launch = time.perf_counter() - (time.time() - started)
        results = self._start()
        results["started"] = started  # the report's wall time runs from here to its writing (finish.py)
        done = self._finished_before()
        if done is not None:
            return done
        peak, results["peak_source"] = peak_flops(self.cfg.hardware, self.pol, self.device)
        results["peak_flops"] = peak
        clock = Clock(self.run, FlopCount.from_model(self.model, self.run), peak, t_launch, on_step=self.dog.step_time)
        shapes = plan_check.Shapes()
        memory = plan_check.Memory(self.device, self.cfg.plan.check_after_steps, self.cfg.train.max_steps)
        parts = Parts(run=self.run, state=self.state, method=self.method, backend=self.backend, clock=clock,
                      tracker=self.tracker, checkpoints=self.checkpoints, evaluator=self.evaluator, shapes=shapes,
                      memory=memory, dropout=self.dropout,
                      plan_check=lambda: finish.plan_check(self.run, self.run_dir, self.state.step, self.tracker,
                                                           memory, shapes))
        # SIGTERM/SIGINT: finish the step, checkpoint, exit 75; NaN/Inf: skip or stop (workbench/guard/faults.py)
        guard = faults.Guard(self.run, self.backend, say=self.tracker.console)
        guard.install()
        startup.training()  # the collector runs again from here (workbench/core/startup.py)
        stalled = loop(parts, guard, self.method.stall_watch(), results)
        memory.close()
        self._last_checkpoint(stalled, results)
        guard.uninstall()  # from here on (eval, export) a signal stops the run as usual
        results.update(bad_steps=guard.bad_steps, losses=clock.losses, first_step_seconds=clock.first_step_at,
                       wall_seconds=time.time() - started)
        if self.cfg.eval.at_end:
            results["eval_end"] = self.evaluator.evaluate("end", self.state)
        finish.export_and_report(self.run, self.run_dir, results, backend=self.backend, tokenizer=self.tokenizer,
                                 contract=self.contract, checkpoints=self.checkpoints, tracker=self.tracker,
                                 secrets=self.secrets)
        if self.is_main:
            for line in finish.summary(self.run_dir, self.cfg, self.state.step, self.checkpoints.resumed_step,
                                       self.tracker.rows, results):
                self.tracker.console(line)
        return results

    def _finished_before(self) -> dict | None:
        """A relaunch of a finished run (train.resume=auto; its last step checkpointed, its results
        written) trains, evaluates and exports nothing again: it says so and returns those results.
        A named checkpoint (train.resume=<path>, as `python -m workbench.export` passes) is redone."""
        stored = self.run_dir / "results.json"
        if (self.cfg.train.resume != "auto" or self.checkpoints.resumed_step < self.cfg.train.max_steps
                or not stored.exists()):
            return None
        if self.is_main:
            self.tracker.console(f"already finished: {self.run_dir} trained {self.state.step} of train.max_steps="
                                 f"{self.cfg.train.max_steps} steps; nothing to do (results.json, report.md there). "
                                 f"Raise train.max_steps to train further{_extend_note(self.cfg)}, or choose a new "
                                 "output_dir")
        self.tracker.finish(None)
        return json.loads(stored.read_text())

    def _start(self) -> dict:
        """The tracker, the model (unless built), resume, the manifest and the evaluation at start."""
        cfg = self.cfg
        self.tracker = Tracker(self.run_dir, enabled=self.is_main, cfg=cfg)  # + trackers, progress
        self.tracker.set_price(cfg.hardware.price_per_hour, self.world)
        if self.backend is None:
            self.build()
        self.checkpoints = Checkpoints(self.run, self.run_dir, self.backend, self.method, self.identity, self.tracker)
        self.evaluator = Evaluator(self.run, self.run_dir, self.backend, self.tokenizer, self.contract, self.tracker,
                                   self.checkpoints)
        resumed, self.state = self.checkpoints.resume(self.state)
        if resumed is None:  # a resume says "resuming from step N" (workbench/checkpoints/run.py)
            self.tracker.console(f"new run in {self.run_dir}: {resume.describe(resume.layout_of(cfg, self.run))}, "
                                 f"global batch {self.run.batch.describe()}, {cfg.train.max_steps} steps")
        if self.is_main:
            finish.write_manifest(self.run, self.run_dir, data=self.method.data_report(), contract=self.contract,
                                  resumed=resumed, resume=self.checkpoints.resumed, secrets=self.secrets)
        cert = (self.checkpoints.resumed or {}).get("certificate")
        if cert and not cert["ok"] and cfg.train.resume_check == "error":
            raise replay.failure(cert, resumed)  # after the manifest, which records it
        results: dict = {"resumed_from": resumed, "resume": self.checkpoints.resumed, "n_params": self.n_params,
                         "n_trainable": self.n_trainable}
        if cfg.eval.at_start and self.state.step == 0:
            results["eval_start"] = self.evaluator.evaluate("start", self.state)
        return results

    def _last_checkpoint(self, stalled: dict | None, results: dict) -> None:
        """After the loop: a stall puts back the last weights that had signal (they are evaluated
        and exported, not the stalled ones); otherwise the last step is saved. Async saves
        commit before the run reports done."""
        if stalled:
            results["stalled"] = stalled
            self.tracker.console(f"stopped at step {stalled['step']}: {stalled['reason']} ({stalled['summary']}); "
                                 f"evaluating and exporting the weights of step {stalled['last_signal_step']}"
                                 + (f" ({stalled['exported_from']})" if stalled["exported_from"] else ""))
            if stalled["exported_from"]:
                self.checkpoints.load_weights(stalled["exported_from"])
        elif self.state.step and (self.cfg.train.checkpoint_every or self.cfg.train.max_steps):
            self.checkpoints.save(self.state)
        checkpoint.flush()


def _extend_note(cfg) -> str:
    """What raising train.max_steps does to this run's schedule (workbench/checkpoints/resume_changes.py)."""
    if cfg.optim.scheduler == "constant":
        return ""
    return (f" (with train.resume_changes=allow: optim.scheduler={cfg.optim.scheduler} is recomputed over the new "
            "length, which changes the LR of the steps after this one)")
