"""`python -m workbench.report`: compare finished runs, one table and one figure.

    python -m workbench.report runs/a runs/b ...          # one table + one figure for several runs
    python -m workbench.report multirun/2026-11-30_06-00-00   # a sweep dir: every job in it
    python -m workbench.report runs/a --out cmp/            # also write cmp/comparison.{md,png}

Throughput and MFU in the table are each run's median over its logged steps
(workbench/telemetry/compare.py `step_median`), so one unusually slow or fast step does not
stand for the run.

A path that does not exist, or that holds no run (no metrics.jsonl in it or in the job
directories of a sweep), ends the command with one `error:` line naming it, and exit status 2:
comparing the runs that were found and leaving one out without a word would answer another
question than the one asked.
"""

from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path

from workbench.telemetry.compare import compare, run_dirs

USAGE_ERROR = 2


def problem(path: str) -> str | None:
    """Why `path` gives no run to compare, or None."""
    p = Path(path)
    if not p.exists():
        parent = p.parent if str(p.parent) else Path(".")
        near = difflib.get_close_matches(p.name, [c.name for c in parent.iterdir()] if parent.is_dir() else [], n=1)
        hint = f"; did you mean {parent / near[0]}?" if near else ""
        return f"{path}: no such directory{hint}"
    if not p.is_dir():
        return f"{path}: not a directory (give a run directory or a sweep directory)"
    if run_dirs([path]):
        return None
    failed = []
    for job in sorted(d for d in p.iterdir() if d.is_dir()):
        try:
            info = json.loads((job / "sweep_job.json").read_text())
        except (OSError, ValueError):
            continue
        if info.get("error"):
            failed.append(f"job {job.name}: {info['error']}")
    if failed:
        return f"{path}: no job of this sweep trained ({'; '.join(failed)[:400]})"
    return (f"{path}: holds no run (no metrics.jsonl in it, in its subdirectories, or where their sweep_job.json "
            "points); give run directories (output_dir of a run) or a sweep directory")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.report", description="Compare runs: one table, one figure.")
    ap.add_argument("runs", nargs="+", help="run directories, or sweep directories holding runs")
    ap.add_argument("--out", default=None, help="directory for comparison.md and comparison.png "
                                                "(default: the single sweep dir given, else ./comparison)")
    args = ap.parse_args(argv)
    for path in args.runs:
        why = problem(path)
        if why is not None:
            print(f"error: {why}", file=sys.stderr)
            return USAGE_ERROR
    out = args.out
    if out is None:
        single = Path(args.runs[0])
        out = single if len(args.runs) == 1 and not (single / "metrics.jsonl").exists() else Path("comparison")
    table, fig = compare(args.runs, Path(out))
    print(table)
    print(f"\nwritten: {Path(out) / 'comparison.md'}" + (f", {fig}" if fig else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
