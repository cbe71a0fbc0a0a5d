"""Hydra multirun support: per-job run dirs and the sweep summary.

    python -m workbench -m optim.lr=1e-4,3e-4 peft.r=8,16 model=tiny
    python -m workbench -m hydra/sweeper=optuna_accuracy          # Optuna, maximise eval accuracy

Under `-m` each job trains in its own sweep subdir (`config.job_dir`, the `workbench.job_dir`
resolver that `output_dir` in conf/train.yaml goes through). When the sweep ends, `SweepSummary` (a Hydra
callback registered in conf/train.yaml) writes into the sweep dir:

- sweep_summary.md / sweep_summary.csv: swept overrides -> final train loss and eval metrics,
  the best job marked. The columns are the keys the sweep varied: those whose value on the
  multirun's command line is a sweep (`a,b`, `range(...)`, `choice(...)`, `glob(...)`,
  `interval(...)`; read from the `multirun.yaml` Hydra writes into the sweep dir), and those whose
  values differ between jobs (what an Optuna sweeper chose, or any sweep without that file). The
  overrides every job shared are listed once above the table;
- loss_curves.png: each job's loss curve, side by side, on a shared y axis.

Each job also leaves `sweep_job.json` in its Hydra job dir (where its results live, its status),
so the summary finds jobs that wrote their run dir elsewhere or ran on another machine.

A job that fails does not end the sweep: the CLI (workbench/cli.py) writes its one error line
to `error.json` in the job dir (`record_error`) and returns; the job is FAILED in the summary,
its error beside it, and the command exits 2 after the summary.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from workbench.core.secrets import redact, redact_overrides, secret_values
from workbench.telemetry import compare, plots

log = logging.getLogger(__name__)
JOB_FILE = "sweep_job.json"
ERROR_FILE = "error.json"  # a failed job's error line, beside JOB_FILE
MULTIRUN_FILE = "multirun.yaml"  # Hydra's copy of the multirun's config, in the sweep dir
# This process's failed sweep jobs ("job <n>: <error line>") and where its summary goes: the CLI
# exits 2 after the sweep when there are any (workbench/cli.py main)
FAILED_JOBS: list[str] = []
SUMMARY: list[str] = []


def record_error(job_dir, line: str) -> None:
    """A failed job's error, one line (scrubbed by the caller), where on_job_end and the summary read it."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / ERROR_FILE).write_text(json.dumps({"error": " ".join(line.split())}))


def record_lost_job(job_dir, overrides, line: str) -> None:
    """A job that ended without running the CLI (a Slurm job whose processes never started): its
    overrides and error where the summary reads a job (workbench/launch/slurm_follow.py)."""
    record_error(job_dir, line)
    info = {"overrides": [str(o) for o in overrides], "status": "FAILED", "error": " ".join(line.split())}
    (Path(job_dir) / JOB_FILE).write_text(json.dumps(info, indent=1))


def recorded_error(job_dir) -> str | None:
    path = Path(job_dir) / ERROR_FILE
    try:
        return json.loads(path.read_text()).get("error") if path.is_file() else None
    except (OSError, ValueError):
        return "the job failed (its error.json is unreadable)"


def _one_line(value) -> str | None:
    """A failed job's return value (the exception Hydra caught) as one line."""
    if value is None:
        return None
    text = f"{type(value).__name__}: {value}" if isinstance(value, BaseException) else str(value)
    return " ".join(text.split())[:500]


# -- reading jobs -------------------------------------------------------------------------------
def _load_job(jdir: Path) -> dict | None:
    info_path = jdir / JOB_FILE
    ov_path = jdir / ".hydra" / "overrides.yaml"
    if not info_path.exists() and not ov_path.exists():
        return None
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    overrides = info.get("overrides")
    if overrides is None:
        overrides = list(OmegaConf.load(ov_path)) if ov_path.exists() else []
    run = compare.read_run(info.get("output_dir") or jdir)  # results and curves, as the report reads them
    try:
        num = int(jdir.name)
    except ValueError:
        num = jdir.name
    error = info.get("error") or recorded_error(jdir)
    status = "FAILED" if error else info.get("status", "COMPLETED" if run.results else "NO_RESULTS")
    return {"num": num, "dir": str(run.dir), "overrides": [str(o) for o in overrides], "run": run,
            "status": status, "error": error}


def collect(sweep_dir: Path) -> list[dict]:
    jobs = [j for d in sorted(Path(sweep_dir).iterdir()) if d.is_dir() and (j := _load_job(d))]
    return sorted(jobs, key=lambda j: (isinstance(j["num"], str), j["num"]))


def command_line_sweeps(sweep_dir) -> set[str] | None:
    """The override keys the multirun's command line swept (`optim.lr=1e-4,3e-4`, `range(...)`,
    `choice(...)`, `glob(...)`, `interval(...)`), as the per-job overrides spell them (`+` and
    package included); None when the sweep dir has no readable multirun.yaml.

    Each job's own overrides (`hydra.overrides.task`) hold one value per key, the fixed ones
    alongside the swept ones, so with one job nothing tells them apart; multirun.yaml keeps the
    command line as typed."""
    path = Path(sweep_dir) / MULTIRUN_FILE
    if not path.is_file():
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        # plain YAML, not OmegaConf: an override may quote an interpolation, never resolved here
        hydra = (yaml.safe_load(path.read_text()) or {}).get("hydra") or {}
        typed = (hydra.get("overrides") or {}).get("task") or []
        parsed = OverridesParser.create().parse_overrides([str(o) for o in typed])
    except Exception as e:  # unreadable: the columns fall back to what differs between jobs
        # the type only: a parse error quotes the override, which may hold a secret
        log.warning(f"sweep summary: {path} unreadable ({type(e).__name__}); swept keys taken from the jobs")
        return None
    return {o.get_key_element() for o in parsed if o.is_sweep_override()}


def _pairs(job: dict) -> dict[str, str]:
    return dict(o.partition("=")[::2] for o in job["overrides"])


def _swept(jobs: list[dict], from_command_line: set[str] | None = None) -> list[str]:
    """The override keys the sweep varied, in first-seen order: those the command line swept, and
    those whose values differ between jobs (a key some jobs lack differs too). A job that recorded
    no overrides at all is left out of the comparison: it says nothing about them."""
    maps = [_pairs(j) for j in jobs if j["overrides"]]
    keys = list(dict.fromkeys(k for m in maps for k in m))
    varied = set(from_command_line or ()) | {k for k in keys if len({m.get(k) for m in maps}) > 1}
    return [k for k in keys if k in varied]


def _fixed(jobs: list[dict], swept: list[str]) -> list[str]:
    """The overrides every job shared (the keys not swept), as the first job spelt them."""
    first = next((j for j in jobs if j["overrides"]), None)
    return [o for o in first["overrides"] if o.partition("=")[0] not in swept] if first else []


def _value(job: dict, key: str) -> str:
    for o in job["overrides"]:
        k, _, v = o.partition("=")
        if k == key:
            return v
    return ""


def _label(job: dict, swept: list[str], form: str, sep: str = " ") -> str:
    """The job's swept values, `key=value` joined by `sep` into `form`; "" when nothing was swept."""
    return form.format(sep.join(f"{k}={_value(job, k)}" for k in swept)) if swept else ""


# -- writing the summary ------------------------------------------------------------------------
def summarize(sweep_dir: Path, metric: str = "auto", mode: str = "auto", plot: bool = True) -> dict:
    """Write sweep_summary.{md,csv} and loss_curves.png into `sweep_dir`; return what was written.
    The jobs are read, measured and ranked as workbench/telemetry/compare.py does for any runs."""
    sweep_dir = Path(sweep_dir)
    jobs = collect(sweep_dir)
    if not jobs:
        return {}
    measured = [compare.final_metrics(j["run"]) for j in jobs]
    metric, mode, index = compare.rank(measured, metric, mode)
    best = None if index is None else jobs[index]["num"]
    swept = _swept(jobs, command_line_sweeps(sweep_dir))
    fixed = _fixed(jobs, swept)
    mkeys = ["final_loss"] + sorted({k for m in measured for k in m} - {"final_loss", "steps"})

    header = ["job", *swept, "steps", *mkeys, "status", "best"]
    rows: list[list] = []
    for j, m in zip(jobs, measured, strict=True):
        rows.append([j["num"], *(_value(j, k) for k in swept), m.get("steps"), *(m.get(k) for k in mkeys),
                     j["status"], "*" if j["num"] == best else ""])
    failed = [j for j in jobs if j["error"]]

    with (sweep_dir / "sweep_summary.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        # an `error` column only when a job failed, so a clean sweep's table is as before
        w.writerow(header + (["error"] if failed else []))
        w.writerows(r + ([j["error"] or ""] if failed else []) for r, j in zip(rows, jobs, strict=True))
    title = f"best by {metric} ({'higher' if mode == 'max' else 'lower'} is better): job {best}" if best is not None \
        else "no job reported a metric to rank by"
    count = f"{len(jobs)} jobs" + (f", {len(failed)} failed" if failed else "")
    md = [f"# Sweep summary: {sweep_dir}", "", f"{count}; {title}.", ""]
    if fixed:  # once here rather than a column of one value per job
        md += ["Fixed overrides (every job): " + " ".join(f"`{o}`" for o in fixed), ""]
    md += compare.markdown(header, [[compare.fmt(c) for c in r[:-1]] + ["**best**" if r[-1] else ""] for r in rows])
    if failed:
        md += ["", "Failed jobs:", ""] + [f"- job {j['num']}{_label(j, swept, ' ({})')}: {j['error']}" for j in failed]
    md += ["", "Run dirs:", ""] + [f"- job {j['num']}: `{j['dir']}`" for j in jobs]
    (sweep_dir / "sweep_summary.md").write_text("\n".join(md) + "\n")

    written = {"markdown": str(sweep_dir / "sweep_summary.md"), "csv": str(sweep_dir / "sweep_summary.csv"),
               "best_job": best, "metric": metric, "mode": mode, "failed": [j["num"] for j in failed],
               "swept": swept, "fixed": fixed}
    if plot and any(j["run"].rows for j in jobs):
        panels = [(f"#{j['num']}{' (best)' if j['num'] == best else ''}\n"
                   + (_label(j, swept, "{}", ", ") or "(nothing swept)"),
                   j["run"].rows, j["num"] == best, f"no results ({j['status']})") for j in jobs]
        written["plot"] = str(plots.side_by_side(panels, sweep_dir / "loss_curves.png"))
    return written


class SweepSummary(Callback):
    """Hydra callback: records each job, and summarizes the sweep when it ends."""

    def __init__(self, metric: str = "auto", mode: str = "auto", plot: bool = True):
        self.metric, self.mode, self.plot = metric, mode, plot

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.types import RunMode


        hc = config.hydra
        if hc.mode != RunMode.MULTIRUN:
            return
        jdir = Path(hc.runtime.output_dir)
        try:
            out = str(config.output_dir)
        except Exception:  # an unresolvable output_dir: the job failed before using it
            out = str(jdir)
        status = getattr(job_return.status, "name", str(job_return.status))
        error = recorded_error(jdir)  # the CLI caught the job's error and returned (record_error)
        if error:
            status = "FAILED"
        elif status != "COMPLETED":  # an exception Hydra caught
            error = _one_line(getattr(job_return, "_return_value", None))
        info = {"output_dir": out, "overrides": list(hc.overrides.task), "status": status, "error": error}
        try:
            info["return_value"] = job_return.return_value if status == "COMPLETED" else None
        except Exception:
            info["return_value"] = None
        jdir.mkdir(parents=True, exist_ok=True)
        # the overrides and the error copy the command line: secrets out (workbench/core/secrets.py)
        secrets = secret_values(config)
        info = redact({**info, "overrides": redact_overrides(info["overrides"], secrets)}, secrets)
        (jdir / JOB_FILE).write_text(json.dumps(info, indent=1, default=str))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.exists():
            return
        written = summarize(sweep_dir, self.metric, self.mode, self.plot)
        if written:
            log.info(f"sweep summary: {written['markdown']} (best job: {written['best_job']} by {written['metric']})")
            print(f"sweep summary: {written['markdown']}", flush=True)
