"""The one training loop every method and backend shares.

    for step in range(start, max_steps):
        batch   = method.next_batch(state, backend)          # GRPO: rollouts + rewards here
        metrics = backend.forward_backward(batch, method.loss)
        metrics |= backend.optimizer_step()
        log, evaluate, checkpoint

Order of work is chosen so mistakes surface early: tokenizer and data are read and checked
before any weights load, then the model, adapters and precision, then resume, then the loop.
Rank 0 writes logs, checkpoints pointers, the export and the report.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from workbench.backends import registry as backends
from workbench.config.resolved import resolve as resolve_run
from workbench.config.run import Run
from workbench.core import heartbeat, startup
from workbench.core.errors import UserError
from workbench.core.secrets import redact, secret_values
from workbench.evals import hooks
from workbench.methods import registry as methods
from workbench.models.build import build_model
from workbench.models.head import SelectiveLM
from workbench.models.load import resolve
from workbench.telemetry import manifest, plan_check, report
from workbench.telemetry.flops import FlopCount
from workbench.telemetry.metrics import Tracker, throughput
from workbench.telemetry.peak import peak_flops
from workbench.train import canonical, checkpoint, faults, noise, precision, replay, resume
from workbench.train.distributed import init_distributed
from workbench.train.state import TrainState, rng_state, seed_everything, set_rng_state
from workbench.train.watchdog import Watchdog, gpu_env


@dataclass(frozen=True)
class Context:
    """What methods and backends may read while they set themselves up: the resolved run
    (precision, peft, reference, layout; workbench/config/resolved.py) and the tokenizer."""

    run: Run
    tokenizer: object
    contract: object
    run_dir: Path

    @property
    def cfg(self) -> DictConfig:
        return self.run.cfg

    @property
    def device(self) -> str:
        return self.run.device


class Runner:
    def __init__(self, cfg: DictConfig, run: Run | None = None, tokenizer: tuple | None = None):
        """`run`, `tokenizer`: the resolved run and the (tokenizer, chat contract) preflight made in
        this process, if any (else made here)."""
        self.cfg = cfg
        self.run_dir = Path(cfg.output_dir)
        self.device = cfg.hardware.device
        if cfg.hardware.threads:
            torch.set_num_threads(cfg.hardware.threads)
        for key, value in (cfg.hardware.env or {}).items():  # NCCL presets, also under the user's own torchrun
            os.environ.setdefault(str(key), str(value))
        if self.device == "cuda":  # NCCL's own watchdog and flight recorder (workbench/train/watchdog.py)
            for key, value in gpu_env(self.run_dir).items():
                os.environ.setdefault(key, value)
        self.rank, self.world = init_distributed(self.device, cfg.hardware.timeout_minutes)
        self.is_main = self.rank == 0
        if run is None or (run.layout.rank, run.layout.world) != (self.rank, self.world):
            run = resolve_run(cfg, self.rank, self.world)  # the rule table runs here too
        self.run_facts = run
        self.cfg = cfg = run.cfg  # a resume at another world size changes train.grad_accum (config/resolved.py)
        self.pol = self.run_facts.precision
        self.backend = None  # build() sets model, method, backend
        self._best = None  # train.keep_best's keeper, made at the first evaluation
        self._resumed: dict | None = None  # where the run resumed from, its certificate (workbench/train/replay.py)
        self._eval_cache: dict = {}  # eval data tokenised once per run
        self._tokenizer = tokenizer
        self._rss0 = plan_check.rss_gib()
        self._secrets = secret_values(cfg)  # values of secret-looking keys, scrubbed from what the run writes
        seed_everything(cfg.train.seed)

    # -- build ---------------------------------------------------------------------------
    def build(self) -> None:
        cfg = self.cfg
        if self._tokenizer is None:
            from workbench.config.preflight import tokenizer

            self._tokenizer = tokenizer(cfg)
        self.tokenizer, self.contract = self._tokenizer
        # a checkpoint of another model, adapter or tokenizer is refused before any weights load
        self._identity = resume.identity(cfg, self.run_facts, self.tokenizer, self.contract)
        resume.check_identity(resume.record_of(self.run_dir, cfg.train.resume), self._identity)
        self.ctx = Context(self.run_facts, self.tokenizer, self.contract, self.run_dir)
        self.method = methods.spec(cfg.method.name).build(cfg.method, self.ctx)
        self.method.prepare(self.ctx)  # data errors surface here, before any weights load

        torch.manual_seed(cfg.train.seed)
        if cfg.model.loader == "unsloth":  # unsloth loads and patches LoRA/QLoRA itself
            from workbench.models import unsloth_loader

            self.model = unsloth_loader.load(self.run_facts, self.run_dir)
            precision.cast_params(self.model, self.pol)
            if self.pol.fp8:
                precision.apply_fp8(self.model, self.pol)
        else:
            self._rss0 = plan_check.rss_gib()  # the plan check's CPU memory baseline: before the weights
            self.model = build_model(self.run_facts)
            plan_check.reset_peak()  # the weights stay counted; a cold cache's conversion peak does not
        self.train_module = SelectiveLM(self.model)
        if cfg.train.compile:
            self.train_module.compile()
        self.backend = backends.spec(cfg.backend.name).build(cfg.backend, self.ctx)
        self.backend.wrap(self.train_module, self.ctx)
        self.method.attach(self.backend)  # e.g. DPO's reference log-probs, once the backend holds the model
        self.state = TrainState()
        # dropout draws its masks keyed by the micro-batch's global samples (workbench/train/noise.py)
        self._dropout = (any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())
                         or float(getattr(self.model.config, "attention_dropout", 0.0) or 0.0) > 0)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.n_trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def _resume(self) -> str | None:
        # resume_point verifies each checkpoint's files and falls back past a damaged one
        path = checkpoint.resume_point(self.run_dir, self.cfg.train.resume)
        self._resumed = None
        if path is None:
            return None
        if checkpoint.is_legacy(path):  # from before the canonical format: only at its own layout
            resume.check_legacy({"format": "legacy", "name": path.name, "layout": checkpoint.legacy_layout(path)},
                                self.cfg, self.world)
            self.backend.load_legacy(path, self.rank)
            meta = checkpoint.legacy_meta(path, self.rank)
            self.method.load_state_dict(meta["method"])
            self.state = TrainState(**meta["train_state"])
            set_rng_state(meta["rng"])
            return str(path)
        rec, here = checkpoint.record(path), resume.layout_of(self.cfg, self.run_facts)
        if self.cfg.train.keep_global_batch and rec["global_batch"] != self.run_facts.batch.size:
            raise UserError(f"{path.name} has global batch {rec['global_batch']}, this run {self.run_facts.batch.size}; "
                            "resume it with its own train.micro_batch_size, or train.keep_global_batch=false")
        self.backend.load_canonical(canonical.reader(path / checkpoint.CANONICAL, where=path.name))
        self.backend.load_schedule(rec["schedule"])
        self.method.load_state_dict(rec["method"])
        self.state = TrainState(**rec["train_state"])
        written = rec["layout"]
        same = all(written.get(k) == here[k] for k in ("backend", "world", "tp", "pp", "stage"))
        saved_rng = checkpoint.rng(path, self.rank) if same else None
        if saved_rng is not None:
            set_rng_state(saved_rng)
        else:  # another layout: each rank's generator starts from (seed, step, rank)
            seed_everything(noise.key(self.cfg.train.seed, self.state.step, self.rank) % (1 << 32))
        cert = replay.certificate(rec["probe"], replay.probe_loss_of(self.backend, rec["probe"], self.device),
                                  resume.describe(written), resume.describe(here),
                                  (written["precision"], here["precision"]))
        b = self.run_facts.batch
        self._resumed = {"from": str(path), "certificate": cert, "batch": (
            f"global batch {b.size} = {b.micro} x {b.accum} x {b.dp} data-parallel (written as {written['micro']} x "
            f"{written['accum']} x {written['dp']}), {self.state.samples_seen} samples seen, RNG "
            + ("restored" if saved_rng is not None else "re-seeded for the new layout"))}
        if not same or (written["micro"], written["accum"], written["dp"]) != (b.micro, b.accum, b.dp):
            self._say(f"resuming {path.name} written by {cert['from']} under {cert['to']}: {self._resumed['batch']}; "
                      f"certificate {'ok' if cert['ok'] else 'FAILED'} (rel diff {cert['rel_diff']:.1e}, "
                      f"tolerance {cert['tolerance']:.0e})")
        return str(path)

    def _say(self, line: str) -> None:
        if self.is_main:
            import sys

            print(line, file=sys.stderr, flush=True)

    def _save(self) -> Path:
        with heartbeat.phase("checkpoint"):
            return self._write_checkpoint()

    def _write_checkpoint(self) -> Path:
        spec = replay.probe_spec(self.cfg)
        probe = replay.probe_loss_of(self.backend, spec, self.device)  # the weights being saved (collective)
        record = {"format": canonical.FORMAT, "step": self.state.step, "samples_seen": self.state.samples_seen,
                  "global_batch": self.run_facts.batch.size, "train_state": self.state.to_dict(),
                  "layout": resume.layout_of(self.cfg, self.run_facts), "method": self.method.state_dict(),
                  "schedule": self.backend.schedule_state(), "identity": self._identity,
                  "probe": {**spec, "loss": probe}}
        barrier = dist.barrier if dist.is_initialized() else (lambda: None)
        with self.tracker.progress.status(f"checkpoint step {self.state.step}"):
            return checkpoint.save(self.run_dir, self.state.step, self.backend.save_canonical, record, rng_state(),
                                   self.rank, keep=self.cfg.train.keep_checkpoints, barrier=barrier)

    def _plain_model(self):
        """The trained model as a plain module; under sharding backends a collective that
        gathers full weights onto rank 0 (None on the other ranks)."""
        return self.backend.gathered_model()

    def _evaluate(self, tag: str) -> dict:
        if not self.cfg.eval.tasks:
            return {}
        with heartbeat.phase("evaluation", tag):
            return self._run_evaluations(tag)

    def _run_evaluations(self, tag: str) -> dict:
        model = self._plain_model()
        if not self.is_main:
            return {}
        t = time.perf_counter()
        try:
            with self.tracker.progress.status(f"eval [{tag}]"):  # spinner / bar text / plain lines
                res = hooks.run(model, self.tokenizer, self.contract, self.cfg.eval,
                                autocast=precision.autocast(self.pol, self.device), cfg=self.cfg,
                                step=self.state.step, tag=tag, run_dir=self.run_dir,
                                cache=self._eval_cache)
        except hooks.EvalHookError as exc:
            raise hooks.EvalHookError(f"{exc}; {self._keep_checkpoint(tag)}") from exc
        res["eval_seconds"] = time.perf_counter() - t
        self.tracker.log_eval(res, self.state.step)
        hooks.log_metrics(self.run_dir, res, self.state.step, tag)  # eval rows in metrics.jsonl carry `eval`
        if self.cfg.train.keep_best and tag != "start":  # copy this step's checkpoint to checkpoints/best/
            from workbench.train.keep_best import Keeper

            if self._best is None:
                self._best = Keeper(self.run_dir, self.cfg.train.keep_best, self.cfg.train.keep_best_mode)
            if self._best.update(res, self.state.step):
                self.tracker.console(f"best {self._best.key[5:]}={self._best.best['value']:.4g} at step "
                                     f"{self.state.step}: kept in {self._best.path}")
        self.tracker.console(f"eval ({tag}) " + ", ".join(f"{k[5:]}={v:.4g}" for k, v in res.items()
                                                          if k.startswith("eval/") and isinstance(v, float)
                                                          and not k.endswith("/seconds")))
        return res

    def _load_best(self) -> str:
        """train.export_best: put the best evaluated checkpoint's weights back before the export."""
        from workbench.train.keep_best import best_dir

        path = best_dir(self.run_dir)
        if path is None:
            self.tracker.console("train.export_best: no best checkpoint was kept; exporting the last weights")
            return "last"
        self._load_weights(path)
        return str(path)

    def _load_weights(self, path) -> None:
        """Put a saved checkpoint's weights (and optimizer) back into the backend."""
        path = Path(path)
        if checkpoint.is_legacy(path):
            self.backend.load_legacy(path, self.rank)
        else:
            self.backend.load_canonical(canonical.reader(path / checkpoint.CANONICAL, where=path.name))

    def _keep_checkpoint(self, tag: str) -> str:
        """After an eval hook failed: make sure the trained weights so far are on disk, and say where."""
        if tag == "start":
            return "nothing was trained yet"
        if tag == "step" and self.world == 1:
            latest = checkpoint.latest(self.run_dir)
            if latest is None or not str(latest).endswith(f"{self.state.step:08d}"):
                self._save()  # a checkpoint of the step the hook failed at (single process only: no peers)
            checkpoint.flush()
        return f"the run's checkpoint is kept: {checkpoint.latest(self.run_dir)}"

    # -- loop ----------------------------------------------------------------------------
    def run(self) -> dict:
        """Train, evaluate, export and report, with the watchdog on (workbench/train/watchdog.py):
        an error here reaches the other ranks at once, a stall anywhere ends the run with stacks."""
        cfg = self.cfg
        self.dog = Watchdog(self.run_dir, self.rank, self.world, cfg.hardware.stall_timeout_s, cfg.eval.timeout_s,
                            last_checkpoint=lambda: checkpoint.latest_valid(self.run_dir), secrets=self._secrets)
        if cfg.debug.hang_phase and self.rank == cfg.debug.hang_rank:
            heartbeat.BEAT.hang = (cfg.debug.hang_phase, cfg.debug.hang_at_step)
        if cfg.hardware.watchdog:
            self.dog.start()
        try:
            return self._run()
        except BaseException as exc:
            # a collective that failed because a peer is gone names the peer (workbench/train/watchdog.py)
            blamed = self.dog.blame(exc) if isinstance(exc, (RuntimeError, dist.DistBackendError)) else exc
            self.dog.fail(blamed)  # the other ranks stop now
            if blamed is not exc:
                raise blamed from exc
            raise
        finally:
            self.dog.stop()

    def _run(self) -> dict:
        t_launch = time.perf_counter()
        cfg = self.cfg
        self.tracker = Tracker(self.run_dir, enabled=self.is_main, cfg=cfg)  # + trackers, progress
        self.tracker.set_price(cfg.hardware.price_per_hour, self.world)
        if self.backend is None:
            self.build()
        resumed = self._resume()
        if self.is_main:
            self._write_manifest(resumed)
        cert = (self._resumed or {}).get("certificate")
        if cert and not cert["ok"] and cfg.train.resume_check == "error":
            raise replay.failure(cert, resumed)  # after the manifest, which records it
        results: dict = {"resumed_from": resumed, "resume": self._resumed, "n_params": self.n_params,
                         "n_trainable": self.n_trainable}
        if cfg.eval.at_start and self.state.step == 0:
            results["eval_start"] = self._evaluate("start")
        peak, results["peak_source"] = peak_flops(cfg.hardware, self.pol, self.device)
        results["peak_flops"] = peak
        flop_count = FlopCount.from_model(self.model, self.run_facts)  # FLOPs as computed (workbench/telemetry/flops.py)
        losses, first_step_at = [], None
        # SIGTERM/SIGINT: finish the step, checkpoint, exit 75; NaN/Inf: skip or stop (workbench/train/faults.py)
        self._seen = plan_check.Shapes()
        guard = faults.Guard(self.run_facts, self.backend, say=self.tracker.console)
        guard.install()
        watch = self.method.stall_watch()  # GRPO can run out of gradient (workbench/train/signal.py)
        stalled = None
        startup.training()  # the collector runs again from here (workbench/core/startup.py)
        while self.state.step < cfg.train.max_steps:
            first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
            if self.state.step == cfg.debug.crash_at_step and self.rank == cfg.debug.crash_rank and first_attempt:
                os._exit(17)  # fault injection: die like a killed rank would
            t0 = time.perf_counter()
            heartbeat.step(self.state.step)
            with heartbeat.phase("data"):  # GRPO marks its rollout and reward functions inside
                batch = self.method.next_batch(self.state, self.backend)
            if self._dropout:
                batch.micro_seeds = self._micro_seeds(len(batch.micro))
            if watch is not None and watch.begins(batch.signal, self.state.step):
                watch.checkpoint = str(self._save())  # the last weights trained with signal
            self._seen.update(batch)  # the batch shapes the plan check plans for
            m = guard.step(batch, self.method.loss, self.state.step, lambda: checkpoint.latest_valid(self.run_dir))
            dt = time.perf_counter() - t0
            self.dog.step_time(dt)
            first_step_at = first_step_at or (time.perf_counter() - t_launch)
            self.state.step += 1
            # data-parallel ranks each see different tokens; tensor/pipeline peers share theirs
            dp = self.run_facts.layout.dp
            self.state.tokens_seen += batch.tokens * dp
            self.state.samples_seen += self.run_facts.batch.size
            loss = m.pop("loss")
            losses.append(loss)
            tps = batch.tokens * dp / dt
            row = {"step": self.state.step, "loss": loss, **m, **batch.info, "tokens": batch.tokens * dp,
                   "tokens_per_s": tps, "step_seconds": dt, "time": time.time(),
                   **throughput(flop_count, batch, dt, peak, dp)}
            self.tracker.log(row, show=self.state.step % cfg.train.log_every == 0 or self.state.step == 1)
            if watch is not None:
                stalled = watch.after(row, batch.signal)
                line = watch.warning(row, batch.signal)
                if line:
                    self.tracker.console(line)
            every = cfg.train.checkpoint_every
            # during a stall the rolling checkpoints would hold weights without signal and could
            # rotate out the one the stall began with
            saved = (every and self.state.step % every == 0 and self.state.step < cfg.train.max_steps
                     and not (watch is not None and watch.idle))
            if saved:
                self._save()
            if guard.stop_requested():  # collective: every rank checkpoints at the same step
                path = self._save() if not saved else checkpoint.ckpt_root(self.run_dir) / f"step-{self.state.step:08d}"
                checkpoint.flush()
                guard.exit_preempted(self.state.step, path)
            if cfg.eval.every_n_steps and self.state.step % cfg.eval.every_n_steps == 0:
                results.setdefault("eval_during", []).append({"step": self.state.step, **self._evaluate("step")})
            if self.state.step == cfg.plan.check_after_steps:
                results["plan_check"] = self._plan_check()
            if stalled:
                break
        if stalled:  # evaluate and export the last weights that had signal, not the stalled ones
            results["stalled"] = stalled
            self.tracker.console(f"stopped at step {stalled['step']}: {stalled['reason']} ({stalled['summary']}); "
                                 f"evaluating and exporting the weights of step {stalled['last_signal_step']}"
                                 + (f" ({stalled['exported_from']})" if stalled["exported_from"] else ""))
            if stalled["exported_from"]:
                self._load_weights(stalled["exported_from"])
        elif self.state.step and (cfg.train.checkpoint_every or cfg.train.max_steps):
            self._save()
        checkpoint.flush()  # async saves commit before the run reports done
        guard.uninstall()  # from here on (eval, export) a signal stops the run as usual
        results.update(bad_steps=guard.bad_steps)
        results.update(losses=losses, first_step_seconds=first_step_at, wall_seconds=time.perf_counter() - t_launch)
        if cfg.eval.at_end:
            results["eval_end"] = self._evaluate("end")
        if cfg.train.export and cfg.train.export_best:
            results["exported_from"] = self._load_best()
        with heartbeat.phase("export"):
            trained = self._plain_model() if cfg.train.export else None  # collective under sharding
            if self.is_main and cfg.train.export:
                from workbench.export.write import export

                results["export"] = export(trained, self.tokenizer, self.contract, self.run_facts,
                                           self.run_dir / "export", results)
        if self.is_main:
            # results copy eval prompts and samples, which may quote a token: redacted on the way to disk
            report.write(self.run_dir, self.run_facts, redact(results, self._secrets), self.tracker.rows)
            self.tracker.finish(self.run_dir / "plots")  # plots to the trackers; close them
        if dist.is_initialized():
            dist.barrier()
        failed = (results.get("export") or {}).get("failed")
        if failed and not cfg.export.allow_mismatch:  # after the report, which shows the numbers
            raise UserError(f"export: the parity gate failed for {', '.join(failed)} (see {self.run_dir}/report.md "
                            "and results.json); the files are kept; export.allow_mismatch=true accepts them")
        return results

    def _micro_seeds(self, n: int) -> list[int]:
        """A seed per micro-batch from its first row's global sample index: the same rows get the
        same dropout masks at any world size (workbench/train/noise.py)."""
        b, lay = self.run_facts.batch, self.run_facts.layout
        first = self.state.step * b.size + lay.dp_rank * b.per_rank
        return [noise.key(self.cfg.train.seed, self.state.step, first + i * b.micro) for i in range(n)]

    def _plan_check(self) -> dict | None:
        """Measured peak memory, step time and tokens/s against the planner's prediction for this
        run (workbench/telemetry/plan_check.py); the peak is the largest over ranks (collective)."""
        from workbench.plan.make import make_plan
        from workbench.train.distributed import all_max

        peak = all_max(plan_check.measured_peak_gib(self.device, self._rss0))
        if not self.is_main:
            return None
        measured = {"peak_gib": peak, **plan_check.step_figures(self.tracker.rows)}
        # planned for the batches the run had (their longest row, the share of positions with a
        # loss), not for data.seq_len's worst case
        here = make_plan(self._seen.config(self.cfg, self.run_facts.facts.generates), others=False,
                         calibrated=False)["here"]
        tokens_per_step = statistics.median(r["tokens"] for r in self.tracker.rows if "tokens" in r)
        tps = here.get("tokens_per_s")
        predicted = {"peak_gib": here["peak_gb"], "step_seconds": tokens_per_step / tps if tps else None,
                     "tokens_per_s": tps}
        check = plan_check.compare(predicted, measured)
        if self.cfg.plan.calibrate:
            check["stored"] = plan_check.store(self.cfg.hardware, self.pol.name, self.cfg.model.name, check,
                                             self.run_dir)
        self.tracker.console(plan_check.line(check, self.state.step))
        return {"steps": self.state.step, **check}

    def _write_manifest(self, resumed) -> None:
        cfg = self.cfg
        data = self.method.data_report()
        man = manifest.build(OmegaConf.to_container(cfg, resolve=True),
                             {"kind": resolve(cfg.model).kind, "name": cfg.model.name}, data, self.contract)
        man["resolved"] = self.run_facts.summary()  # what the config's choices became here (precision=auto, peft, layout)
        man["resumed_from"] = resumed
        if self._resumed:
            man["resume"] = self._resumed  # from, the certificate (workbench/train/replay.py), the batch kept
        man["world_size"] = self.world
        man = redact(man, self._secrets)  # config.yaml below is man["config"]: one redaction for both files
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "manifest.json").write_text(json.dumps(man, indent=1, default=str))
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(man["config"])))
