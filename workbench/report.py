"""`python -m workbench.report`: compare finished runs, one table and one figure.

    python -m workbench.report runs/a runs/b ...          # one table + one figure for several runs
    python -m workbench.report multirun/2026-11-30_06-00-00   # a sweep dir: every job in it
    python -m workbench.report runs/a --out cmp/            # also write cmp/comparison.{md,png}

Throughput and MFU in the table are each run's median over its logged steps
(workbench/telemetry/compare.py `step_median`), so one unusually slow or fast step does not
stand for the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from workbench.telemetry.compare import compare


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m workbench.report", description="Compare runs: one table, one figure.")
    ap.add_argument("runs", nargs="+", help="run directories, or sweep directories holding runs")
    ap.add_argument("--out", default=None, help="directory for comparison.md and comparison.png "
                                                "(default: the single sweep dir given, else ./comparison)")
    args = ap.parse_args(argv)
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
