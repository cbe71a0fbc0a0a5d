"""Command line: `python -m workbench [group=choice ...] [key=value ...]` (Hydra).

    python -m workbench                         # LoRA SFT of SmolLM2-135M on CPU (the default)
    python -m workbench --cfg job               # print the composed config and exit
    python -m workbench -m optim.lr=1e-4,3e-4   # multirun sweep
    python -m workbench dry_run=true            # preflight only: no weights loaded
    python -m workbench dry_run=trace           # ... and the step run on fake tensors (workbench/plan/trace.py)

Exit status: 0 done; 2 a mistake in config, data or environment (one `error:` line, before any
weights load; in a multirun the failed job is listed in the sweep summary, the other jobs go on
and the command exits 2 once the summary is written), a checkpoint that could not be written
(disk full) or more NaN/Inf steps than `train.max_bad_steps`; 3 a rank stalled or another rank
failed (the watchdog, workbench/guard/watchdog.py: stacks in `<run>/stalls/`); 4 with dry_run=true,
the plan does not fit the configured hardware, with dry_run=trace the traced step where it was traced
(the whole plan is printed, then one `error:` line
ending with the smallest change that fits; plan.json=true says `"fits": false` too; in a multirun
it is a failed job of the sweep); 75 preempted by
SIGTERM/SIGINT after writing a checkpoint (relaunch with the same output_dir to continue);
143/130 a second SIGTERM/SIGINT, at once (workbench/guard/faults.py).
Secrets given on the command line are redacted from Hydra's own copies in `<run>/.hydra/` too,
by the rule of workbench/core/secrets.py.
"""

from __future__ import annotations

import shutil
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from workbench.compute.precision import describe
from workbench.config import commandline
from workbench.config.files import CONF_DIR
from workbench.core import startup
from workbench.core.errors import UserError
from workbench.core.imports import import_without_incidentals, skip_bitsandbytes
from workbench.core.secrets import redact_overrides, scrub_exception, scrub_files, scrub_text, secret_values
from workbench.guard.faults import check_config
from workbench.guard.watchdog import save_mistake, save_traceback, traceback_path
from workbench.launch import sweep
from workbench.launch.dispatch import dispatch, torchrun_reason
from workbench.launch.sweep import record_error
from workbench.methods import registry as methods
from workbench.methods.spec import SFT_ROWS
from workbench.resolve.derive import needs_bitsandbytes
from workbench.resolve.validate import validate
from workbench.train.distributed import is_main_process, launched_here, launched_rank


def _redact_hydra_files(cfg: DictConfig) -> None:
    """Hydra writes the composed config and the raw command line into `<run>/.hydra/` (and a
    multirun's `multirun.yaml`) before the job starts, with the command line verbatim: the rule
    of workbench/core/secrets.py is applied to them here, as the run applies it to its own files."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    files = []
    if hc.output_subdir:
        folder = Path(hc.runtime.output_dir) / hc.output_subdir
        files += [folder / "config.yaml", folder / "hydra.yaml", folder / "overrides.yaml"]
    if hc.mode == RunMode.MULTIRUN:
        files.append(Path(hc.sweep.dir) / "multirun.yaml")
    scrub_files(files, secret_values(cfg))


class RedactSecrets(Callback):
    """Hydra callback (conf/train.yaml lists it before `sweep_summary`: Hydra calls multirun-end
    callbacks in reverse order, so this one runs after the summary has written). Scrubs what
    Hydra writes beside each job (`.hydra/`, the sweep dir's `multirun.yaml`) and, at the end,
    `sweep_summary.{md,csv}`, which copy the command line (their sources, `sweep_job.json` and
    `.hydra/overrides.yaml`, are already clean; this keeps the summary clean whatever it copies)."""

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        _redact_hydra_files(config)

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        # Hydra prints a failed job's overrides verbatim ("Error executing job with overrides: ...")
        job_return.overrides = redact_overrides(job_return.overrides or [], secret_values(config))

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        scrub_files([sweep / n for n in ("multirun.yaml", "sweep_summary.md", "sweep_summary.csv",
                                         "optimization_results.yaml")],  # the Optuna sweeper's best params
                    secret_values(config))


def run_job(cfg: DictConfig) -> dict | None:
    # The run's modules (preflight, previews, the plan, the runner, the launchers) are imported
    # here, after _hydra_main set the import guards (workbench/core/imports.py), and only those
    # this command needs: a preview never imports the runner, a dry run never the launchers.
    from workbench.run import preflight

    cfg = validate(cfg)
    check_config(cfg)  # fault/checkpoint settings, train.resume, a writable output_dir
    if cfg.data.preview:  # tokenizer only: render samples with their loss mask and stop
        shape = methods.spec(cfg.method.name).facts.data  # the rows the method reads
        if shape == SFT_ROWS or cfg.get("env") is not None:  # chat rows, or an environment's episodes
            from workbench.run.preview import preview  # deferred: see above

            return preview(cfg)
        from workbench.run import preview_rows  # deferred: see above

        return preview_rows.preview(cfg, shape)
    facts = preflight.check(cfg)
    _say_precision(facts["run"])
    if cfg.dry_run:
        from workbench.plan.make import DOES_NOT_FIT_EXIT, WEIGHTS_FROM, does_not_fit, render, to_json  # deferred

        plan = facts["plan"]
        fits = plan["fits"]
        if cfg.dry_run == "trace":  # the step itself, on fake tensors (workbench/plan/trace.py): its verdict
            from workbench.plan.trace import trace_run  # deferred

            print(f"trace: running the step on fake tensors as rank 0 of {facts['run'].layout.world} ...",
                  file=sys.stderr, flush=True)
            plan["trace"] = trace_run(facts["run"], plan)  # plan.json=true carries it too
            fits = plan["trace"]["fits"] if plan["trace"]["traced"] else fits
        else:  # a plan that only just fits says how to check it (plan.json=true: plan.close_call)
            from workbench.plan.trace import close_call  # deferred

            plan["close_call"] = close_call(facts["run"], plan)
        if cfg.plan.json:  # machine-readable: the plan plus what preflight found, and the verdict
            shown = {k: v for k, v in facts.items() if k not in ("run", "tokenizer")}
            print(to_json({**shown, "fits": fits, "exit_status": 0 if fits else DOES_NOT_FIT_EXIT}))
        else:
            weights = WEIGHTS_FROM.get(facts["model_source"], facts["model_source"])
            print(f"preflight ok: model={cfg.model.name} ({facts['n_params']:,} parameters), method={cfg.method.name}, "
                  f"peft={facts['resolved']['peft']}, backend={cfg.backend.name}; weights: {weights}")
            for w in facts.get("warnings", []):
                print(f"warning: {w}")
            if facts.get("resume"):  # an existing run directory: where it continues and at what batch
                print(facts["resume"])
            reason = torchrun_reason(cfg)
            if reason:
                print(f"launch: torchrun ({reason})")
            render(plan)
            if plan.get("close_call"):
                print(plan["close_call"])
            if "trace" in plan:
                from workbench.plan.trace import lines  # deferred

                print("\n".join(lines(plan["trace"], plan)))
        if not fits:  # the whole plan is printed; the status says it does not fit (4)
            if plan["fits"]:  # the plan fits, its trace does not
                from workbench.plan.make import DoesNotFit  # deferred
                from workbench.plan.trace import refusal  # deferred

                raise DoesNotFit(refusal(plan["trace"]))
            raise does_not_fit(plan)
        return facts
    remote = dispatch(cfg)
    if remote is not None:
        return remote
    from workbench.run.runner import Runner  # deferred: see above

    return Runner(cfg, facts["run"], facts.get("tokenizer")).train()


def _drop_if_empty() -> None:
    """A dry run, a preview or a refused config (a UserError) leaves no run directory behind:
    Hydra made it for the job (`.hydra/` and an empty `cli.log`) and nothing of a run was written
    there, or only the TensorBoard event file the tracker opens when the run starts (a data error
    found as the method prepares its rows comes after that). A sweep's job directories stay (the
    sweep summary lists every job)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return
    out = Path(HydraConfig.get().runtime.output_dir)  # the directory Hydra made for this job
    try:
        names = {p.name for p in out.iterdir()}
        log = out / "cli.log"
        tb = out / "tensorboard"
        events_only = not tb.is_dir() or all(p.name.startswith("events.out.tfevents") for p in tb.iterdir())
        if names <= {".hydra", "cli.log", "tensorboard"} and events_only and (not log.exists() or log.stat().st_size == 0):
            shutil.rmtree(out, ignore_errors=True)
    except OSError:
        return


def _say_precision(run) -> None:
    """"precision: bf16-mixed (auto: ...)" once per run, from the resolved run: by this process,
    unless it is a worker of this workbench's launcher (which said it already) or a rank other than
    0 of a user's torchrun."""
    if launched_here() or not is_main_process():
        return
    summary = run.summary()
    print(describe(summary["precision"], summary.get("precision_auto")), file=sys.stderr)


def _sweep_job_failed(exc: Exception, cfg: DictConfig) -> bool:
    """In a multirun, record a job's error where the sweep summary lists it and say so on stderr;
    True when it did (the job then returns, so Hydra's launcher goes on to the next job: a
    sys.exit here would end the whole sweep, a raise would skip its summary)."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return False
    hc, secrets = HydraConfig.get(), secret_values(cfg)
    if isinstance(exc, UserError):
        line = scrub_text(str(exc), secrets)
    else:  # unexpected: the traceback for whoever reads the log, one line for the summary
        print(scrub_text("".join(traceback.format_exception(exc)), secrets), file=sys.stderr)
        line = scrub_text(f"{type(exc).__name__}: {exc}", secrets)
    line = " ".join(line.split())
    print(f"error: {line}", file=sys.stderr)
    record_error(hc.runtime.output_dir, line)
    sweep.FAILED_JOBS.append(f"job {hc.job.num}: {line}")
    sweep.SUMMARY[:] = [str(Path(hc.sweep.dir) / "sweep_summary.md")]
    return True


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig):
    _redact_hydra_files(cfg)
    unexpected = False  # a crash keeps its run directory (Hydra's .hydra/ says what was run)
    try:
        skip_bitsandbytes(needs_bitsandbytes(cfg))
        if not cfg.data.preview:  # a preview loads the tokenizer only
            import_without_incidentals("transformers.modeling_utils")  # workbench/core/imports.py
        results = run_job(cfg)
    except Exception as exc:
        if launched_here():
            # A worker of this workbench's own launcher: its traceback goes to the run directory
            # (the runner's watchdog wrote it already when the run itself raised) and the launcher
            # prints the one line that names it, instead of Hydra's block or an error line per rank.
            rank = launched_rank()
            if not traceback_path(cfg.output_dir, rank).exists():  # the runner's watchdog wrote it already
                save_traceback(cfg.output_dir, rank, exc, secret_values(cfg))
            save_mistake(cfg.output_dir, rank, exc, secret_values(cfg))  # a restart would meet it again
            sys.exit(getattr(exc, "exit_code", 1))
        if _sweep_job_failed(exc, cfg):
            return None
        if not isinstance(exc, UserError):
            unexpected = True
            # Hydra prints it (its error report, or Python's under HYDRA_FULL_ERROR): when its
            # traceback holds a secret, a stand-in carrying it scrubbed (workbench/core/secrets.py)
            shown = scrub_exception(exc, secret_values(cfg))
            if shown is exc:
                raise
            raise shown from None
        # the message may quote a value from the command line
        print(f"error: {scrub_text(str(exc), secret_values(cfg))}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    finally:
        startup.after_job()  # the garbage collector as it was before the launch (workbench/core/startup.py)
        if not unexpected:
            _drop_if_empty()
    # Hydra's Optuna sweeper and the sweep summary read the job's return value.
    if isinstance(results, dict):
        end = results.get("eval_end") or {}
        acc = [v for k, v in end.items() if k.endswith("/accuracy")]
        losses = results.get("losses") or []
        return acc[0] if acc else (losses[-1] if losses else None)
    return None


def main() -> None:
    if any(a in ("--help", "-h") for a in sys.argv[1:]):  # ours, not Hydra's page (that is --hydra-help)
        print(commandline.usage())
        sys.exit(0)
    sys.argv[1:] = commandline.nulls_as_deletions(sys.argv[1:])
    sys.argv[1:], shared = commandline.per_job_output_dir(sys.argv[1:])
    if shared:
        print(shared, file=sys.stderr)
    mistake = commandline.precheck(sys.argv[1:])
    if mistake:
        print(f"error: {scrub_text(mistake)}", file=sys.stderr)  # the message may quote a value
        sys.exit(2)
    _hydra_main()
    if sweep.FAILED_JOBS:  # a multirun went on past failed jobs; its summary is written, say so last
        more = f" (and {len(sweep.FAILED_JOBS) - 1} more)" if len(sweep.FAILED_JOBS) > 1 else ""
        print(f"error: {len(sweep.FAILED_JOBS)} sweep job(s) failed, {sweep.FAILED_JOBS[0]}{more}; "
              f"see {sweep.SUMMARY[0] if sweep.SUMMARY else 'sweep_summary.md'}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
