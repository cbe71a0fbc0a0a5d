"""Side-by-side benchmarks, measured in one process run and reported as ratios.

    python scripts/bench.py trl        # workbench vs TRL SFT throughput on the embedded task
    python scripts/bench.py --list     # every benchmark

Each benchmark lives in scripts/benchmarks/<name>.py with `run(args: list[str]) -> dict` and
prints a JSON result. Absolute times on shared machines are noise; ratios measured
alternately in one run are what to quote.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def available() -> list[str]:
    return sorted(p.stem for p in (ROOT / "scripts" / "benchmarks").glob("*.py") if not p.stem.startswith("_"))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__)
        print("benchmarks:", ", ".join(available()))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in available():
        print(f"unknown benchmark {name!r}; choose from {available()}")
        return 2
    result = importlib.import_module(f"benchmarks.{name}").run(rest)
    print(json.dumps(result))  # one line
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
