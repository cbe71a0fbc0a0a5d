"""Command line: `python -m workbench [group=choice ...] [key=value ...]` (Hydra).

    python -m workbench                         # LoRA SFT of SmolLM2-135M on CPU (the default)
    python -m workbench --cfg job               # print the composed config and exit
    python -m workbench -m optim.lr=1e-4,3e-4   # multirun sweep
    python -m workbench dry_run=true            # preflight only: no weights loaded

Exit status: 0 done; 2 a mistake in config, data or environment (one `error:` line, before any
weights load), a checkpoint that could not be written (disk full) or more NaN/Inf steps than
`train.max_bad_steps`; 3 a rank stalled or another rank failed (the watchdog,
workbench/train/watchdog.py: stacks in `<run>/stalls/`); 75 preempted by SIGTERM/SIGINT after
writing a checkpoint (relaunch with the same output_dir to continue); 143/130 a second
SIGTERM/SIGINT, at once (workbench/train/faults.py).
Secrets given on the command line are redacted from Hydra's own copies in `<run>/.hydra/` too,
by the rule of workbench/core/secrets.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from workbench.config.files import CONF_DIR
from workbench.config.run import needs_bitsandbytes
from workbench.config.validate import validate
from workbench.core import startup
from workbench.core.errors import UserError
from workbench.core.imports import import_without_incidentals, skip_bitsandbytes
from workbench.core.secrets import scrub_files, scrub_text, secret_values


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

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        scrub_files([sweep / n for n in ("multirun.yaml", "sweep_summary.md", "sweep_summary.csv",
                                         "optimization_results.yaml")],  # the Optuna sweeper's best params
                    secret_values(config))


def run_job(cfg: DictConfig) -> dict | None:
    from workbench.config import preflight

    cfg = validate(cfg)
    from workbench.train.faults import check_config

    check_config(cfg)  # fault/checkpoint settings, train.resume, a writable output_dir
    if cfg.data.preview:  # tokenizer only: render samples with their loss mask and stop
        from workbench.data.preview import preview

        return preview(cfg)
    facts = preflight.check(cfg)
    if cfg.dry_run:
        from workbench.plan.make import render, to_json

        if cfg.plan.json:  # machine-readable: the plan plus what preflight found
            print(to_json({k: v for k, v in facts.items() if k not in ("run", "tokenizer")}))
            return facts
        print(f"preflight ok: model={cfg.model.name} ({facts['n_params']:,} parameters, weights from "
              f"{facts['model_source']}), method={cfg.method.name}, peft={facts['resolved']['peft']}, "
              f"backend={cfg.backend.name}")
        for w in facts.get("warnings", []):
            print(f"warning: {w}")
        if facts.get("resume"):  # an existing run directory: where it continues and at what batch
            print(facts["resume"])
        render(facts["plan"])
        return facts
    from workbench.launch import dispatch

    remote = dispatch(cfg)
    if remote is not None:
        return remote
    from workbench.train.runner import Runner

    return Runner(cfg, facts["run"], facts.get("tokenizer")).run()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _hydra_main(cfg: DictConfig):
    _redact_hydra_files(cfg)
    try:
        skip_bitsandbytes(needs_bitsandbytes(cfg))
        if not cfg.data.preview:  # a preview loads the tokenizer only
            import_without_incidentals("transformers.modeling_utils")  # workbench/core/imports.py
        results = run_job(cfg)
    except UserError as exc:
        # the message may quote a value from the command line
        print(f"error: {scrub_text(str(exc), secret_values(cfg))}", file=sys.stderr)
        sys.exit(getattr(exc, "exit_code", 2))
    finally:
        startup.after_job()  # the garbage collector as it was before the launch (workbench/core/startup.py)
    # Hydra's Optuna sweeper and the sweep summary read the job's return value.
    if isinstance(results, dict):
        end = results.get("eval_end") or {}
        acc = [v for k, v in end.items() if k.endswith("/accuracy")]
        losses = results.get("losses") or []
        return acc[0] if acc else (losses[-1] if losses else None)
    return None


def _precheck(argv: list[str]) -> None:
    """Hydra's own composition errors (a group choice that does not exist, a value of the wrong
    type) as one `error:` line and status 2, like every other mistake, instead of Hydra's
    multi-line report and status 1. Composing once more costs ~0.1 s; only plain overrides are
    checked (Hydra's flags, multirun sweeps and --config-path runs are left to Hydra)."""
    if any(a.startswith("-") for a in argv):
        return
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="train", overrides=list(argv))
    except (HydraException, OmegaConfBaseException) as exc:
        msg = " ".join(str(exc).split()).split(" Config search path:")[0].replace(" _schema", "")
        cause = exc.__cause__
        if cause is not None and str(cause).strip():  # e.g. why a value does not fit its field
            msg += ": " + str(cause).strip().splitlines()[0]
        print(f"error: {scrub_text(msg)}", file=sys.stderr)  # the message may quote a value
        sys.exit(2)


def main() -> None:
    _precheck(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
