"""Comparing finished runs: several run directories read one way, ranked one way, tabled one way.

    python -m workbench.report runs/a runs/b --out cmp/      # compare(): comparison.md + .png
    python -m workbench -m optim.lr=1e-4,3e-4                 # launch/sweep.py: sweep_summary.md/.csv,
                                                             # the best job, loss_curves.png

    run = read_run(run_dir)          # RunRecord: training rows of metrics.jsonl, results.json, config.yaml
    final_metrics(run)               # final_loss, steps and the end-of-training eval numbers
    rank([final_metrics(r) for r in runs], "auto", "auto")   # (metric, mode, index of the best)

Both comparisons read runs through `read_run` and write their tables with `markdown`; the sweep
ranks its jobs with `rank` (the first eval accuracy, higher is better, else the final loss).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.telemetry import plots
from workbench.telemetry.trackers import flatten


@dataclass
class RunRecord:
    """What a finished (or failed) run directory holds, read back for comparison."""

    dir: Path
    rows: list[dict] = field(default_factory=list)  # training steps (eval rows are in results.json)
    results: dict = field(default_factory=dict)  # results.json
    config: dict = field(default_factory=dict)  # config.yaml


def read_run(run_dir) -> RunRecord:
    """What a run directory holds; any of its files may be missing (a job that failed early)."""
    run_dir = Path(run_dir)
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "loss" in r and "eval" not in r]  # eval rows (workbench/evals/hooks.py) carry `eval`
    # a step logged again (trained again after a crash resumed from an earlier checkpoint) counts once, as last trained
    rows = list({r["step"]: r for r in rows}.values()) if all("step" in r for r in rows) else rows
    results = json.loads((run_dir / "results.json").read_text()) if (run_dir / "results.json").exists() else {}
    config = {}
    if (run_dir / "config.yaml").exists():
        from omegaconf import OmegaConf

        config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"))
    return RunRecord(run_dir, rows, results, config)


def run_dirs(paths: list[str]) -> list[Path]:
    """Run directories among `paths`; a directory without metrics.jsonl is searched one level
    down (a multirun sweep dir holds its jobs as 0/, 1/, ...), following each job's
    sweep_job.json to where it trained (a sweep given `output_dir=DIR` trains in DIR/<n>)."""
    out = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").exists():
            out.append(p)
        elif p.is_dir():
            subs = sorted((d for d in p.iterdir() if d.is_dir()),
                          key=lambda d: (not d.name.isdigit(), int(d.name) if d.name.isdigit() else 0, d.name))
            out += [d for d in (_trained_in(d) for d in subs) if d is not None and d not in out]
    return out


def _trained_in(job: Path) -> Path | None:
    """The run directory of a sweep's job directory: itself, or where its sweep_job.json says it
    trained; None when neither holds metrics.jsonl."""
    if (job / "metrics.jsonl").exists():
        return job
    try:
        there = json.loads((job / "sweep_job.json").read_text()).get("output_dir")
    except (OSError, ValueError):
        return None
    return Path(there) if there and (Path(there) / "metrics.jsonl").exists() else None


def final_metrics(run: RunRecord) -> dict[str, float]:
    """Final train loss, the last step and the end-of-training eval numbers of one run."""
    out: dict[str, float] = {}
    losses = run.results.get("losses") or []
    if run.rows:
        out["final_loss"] = run.rows[-1]["loss"]
        out["steps"] = run.rows[-1]["step"]
    elif losses:
        out["final_loss"] = losses[-1]
    for k, v in sorted((run.results.get("eval_end") or {}).items()):
        if isinstance(v, float) and k != "eval_seconds":  # accuracies etc.; counts are ints
            out[k] = float(v)
    return out


def _accuracy(end: dict, k: str) -> str:
    """An accuracy as a percentage, with its 95% interval where the run reports one."""
    if not isinstance(end.get(k), (int, float)):
        return "-"
    ci = end.get(f"{k}_ci95")
    return f"{end[k]:.1%} [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else f"{end[k]:.1%}"


def rank(metrics: list[dict[str, float]], metric: str = "auto", mode: str = "auto"
         ) -> tuple[str | None, str, int | None]:
    """(metric, mode, index of the best run) over runs' `final_metrics`. `auto`: the first eval
    accuracy any run reports (higher is better), else the final loss (lower); a named metric is
    lower-is-better when it is a loss. None when no run reports the metric."""
    if metric == "auto":
        accuracies = sorted({k for m in metrics for k in m if k.endswith("accuracy")})
        metric, mode = (accuracies[0], "max") if accuracies else \
            ("final_loss", "min") if any("final_loss" in m for m in metrics) else (None, "min")
    elif mode == "auto":
        mode = "min" if "loss" in metric else "max"
    scored = [(m[metric], i) for i, m in enumerate(metrics) if metric and m.get(metric) is not None]
    if not scored:
        return metric, mode, None
    return metric, mode, (max if mode == "max" else min)(scored, key=lambda t: t[0])[1]


def fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(cells) + " |" for cells in rows]


def step_median(rows: list[dict], key: str) -> float | None:
    """The median of `key` over a run's logged steps (None when no step logged it). The first step
    (compilation, allocator warm-up) is left out when three or more steps remain, never otherwise:
    leaving it out of a two-step run would leave the last step alone, and one slow or fast step
    would then stand for the whole run."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if len(values) >= 4:
        values = values[1:]
    return statistics.median(values) if values else None


def compare(paths: list[str], out: Path | None = None) -> tuple[str, Path | None]:
    """Markdown table of the runs (the config keys that differ between them, then loss, speed and
    eval; speed as the median over each run's steps, `step_median`) and an overlay figure of
    their curves; written to `out`/comparison.{md,png} when given."""
    dirs = run_dirs(paths)
    if not dirs:
        raise SystemExit(f"no run directories (with metrics.jsonl) among {paths}")
    runs = [read_run(d) for d in dirs]
    flats = [flatten(r.config) for r in runs]
    keys = sorted({k for f in flats for k in f})
    differing = [k for k in keys if k != "output_dir" and len({json.dumps(f.get(k), default=str) for f in flats}) > 1]
    evals = sorted({k for r in runs for k in (r.results.get("eval_end") or {}) if k.endswith("accuracy")})
    head = ["run", *differing, "steps", "loss first", "loss last", "tokens/s (median)", "MFU (median)",
            *[f"{k.removeprefix('eval/')} after" for k in evals]]
    body = []
    for run, f in zip(runs, flats, strict=True):
        tps, mfu = step_median(run.rows, "tokens_per_s"), step_median(run.rows, "mfu")
        losses = [r["loss"] for r in run.rows]
        end = run.results.get("eval_end") or {}
        body.append([str(run.dir), *[str(f.get(k, "")) for k in differing], str(len(run.rows)),
                     f"{losses[0]:.4f}" if losses else "-", f"{losses[-1]:.4f}" if losses else "-",
                     f"{tps:.0f}" if tps is not None else "-", f"{mfu:.1%}" if mfu is not None else "-",
                     *[_accuracy(end, k) for k in evals]])
    table = "\n".join(markdown(head, body))
    fig = None
    names = [", ".join(f"{k.split('.')[-1]}={f.get(k)}" for k in differing) or r.dir.name
             for r, f in zip(runs, flats, strict=True)]
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        fig = plots.overlay(list(zip(names, [r.rows for r in runs], strict=True)), out / "comparison.png")
        text = f"# Comparison of {len(runs)} runs\n\n{table}\n"
        if fig:
            text += f"\n![curves]({fig.name})\n"
        (out / "comparison.md").write_text(text)
    return table, fig
