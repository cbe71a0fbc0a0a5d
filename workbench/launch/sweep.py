"""Hydra multirun support: per-job run dirs and the sweep summary.

    python -m workbench -m optim.lr=1e-4,3e-4 peft.r=8,16 model=tiny
    python -m workbench -m hydra/sweeper=optuna_accuracy          # Optuna, maximise eval accuracy

Under `-m` each job trains in its own sweep subdir (`config.job_dir`, the `workbench.job_dir`
resolver that `output_dir` in conf/train.yaml goes through). When the sweep ends, `SweepSummary` (a Hydra
callback registered in conf/train.yaml) writes into the sweep dir:

- sweep_summary.md / sweep_summary.csv: swept overrides -> final train loss and eval metrics,
  the best job marked;
- loss_curves.png: each job's loss curve, side by side, on a shared y axis.

Each job also leaves `sweep_job.json` in its Hydra job dir (where its results live, its status),
so the summary finds jobs that wrote their run dir elsewhere or ran on another machine.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from workbench.telemetry import compare, plots

log = logging.getLogger(__name__)
JOB_FILE = "sweep_job.json"


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
    return {"num": num, "dir": str(run.dir), "overrides": [str(o) for o in overrides], "run": run,
            "status": info.get("status", "COMPLETED" if run.results else "NO_RESULTS"), "error": info.get("error")}


def collect(sweep_dir: Path) -> list[dict]:
    jobs = [j for d in sorted(Path(sweep_dir).iterdir()) if d.is_dir() and (j := _load_job(d))]
    return sorted(jobs, key=lambda j: (isinstance(j["num"], str), j["num"]))


def _swept(jobs: list[dict]) -> list[str]:
    """Override keys whose values differ between jobs, in first-seen order."""
    seen: dict[str, set] = {}
    for j in jobs:
        for o in j["overrides"]:
            k, _, v = o.partition("=")
            seen.setdefault(k, set()).add(v)
    return [k for k, vals in seen.items() if len(vals) > 1 or len(jobs) == 1]


def _value(job: dict, key: str) -> str:
    for o in job["overrides"]:
        k, _, v = o.partition("=")
        if k == key:
            return v
    return ""


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
    swept = _swept(jobs)
    mkeys = ["final_loss"] + sorted({k for m in measured for k in m} - {"final_loss", "steps"})

    header = ["job", *swept, "steps", *mkeys, "status", "best"]
    rows: list[list] = []
    for j, m in zip(jobs, measured, strict=True):
        rows.append([j["num"], *(_value(j, k) for k in swept), m.get("steps"), *(m.get(k) for k in mkeys),
                     j["status"], "*" if j["num"] == best else ""])

    with (sweep_dir / "sweep_summary.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    title = f"best by {metric} ({'higher' if mode == 'max' else 'lower'} is better): job {best}" if best is not None \
        else "no job reported a metric to rank by"
    md = [f"# Sweep summary: {sweep_dir}", "", f"{len(jobs)} jobs; {title}.", ""]
    md += compare.markdown(header, [[compare.fmt(c) for c in r[:-1]] + ["**best**" if r[-1] else ""] for r in rows])
    md += ["", "Run dirs:", ""] + [f"- job {j['num']}: `{j['dir']}`" for j in jobs]
    (sweep_dir / "sweep_summary.md").write_text("\n".join(md) + "\n")

    written = {"markdown": str(sweep_dir / "sweep_summary.md"), "csv": str(sweep_dir / "sweep_summary.csv"),
               "best_job": best, "metric": metric, "mode": mode}
    if plot and any(j["run"].rows for j in jobs):
        panels = [(f"#{j['num']}{' (best)' if j['num'] == best else ''}\n"
                   + (", ".join(f"{k}={_value(j, k)}" for k in swept) or "(no overrides)"),
                   j["run"].rows, j["num"] == best, f"no results ({j['status']})") for j in jobs]
        written["plot"] = str(plots.side_by_side(panels, sweep_dir / "loss_curves.png"))
    return written


class SweepSummary(Callback):
    """Hydra callback: records each job, and summarizes the sweep when it ends."""

    def __init__(self, metric: str = "auto", mode: str = "auto", plot: bool = True):
        self.metric, self.mode, self.plot = metric, mode, plot

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.types import RunMode

        from workbench.core.secrets import redact, redact_overrides, secret_values

        hc = config.hydra
        if hc.mode != RunMode.MULTIRUN:
            return
        jdir = Path(hc.runtime.output_dir)
        try:
            out = str(config.output_dir)
        except Exception:  # an unresolvable output_dir: the job failed before using it
            out = str(jdir)
        status = getattr(job_return.status, "name", str(job_return.status))
        error = None
        if status != "COMPLETED":
            error = repr(getattr(job_return, "_return_value", None))
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
