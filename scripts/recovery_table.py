"""The recovery table of docs/guides/multi-node.md, made from what the cluster tier measured.

    .venv/bin/python -m pytest -q -m cluster tests/cluster        # appends to runs/cluster-recovery.jsonl
    python scripts/recovery_table.py                              # -> docs/measurements/recovery.json + the table
    python scripts/recovery_table.py --check                      # the page's table is the records' (a test runs this)

Each cluster test that survives a fault records it (tests/cluster/recovery.py): seconds from the
fault until a line named it, until a step was trained again, the steps trained twice (a restart
goes back to its last checkpoint) and the final loss beside the uninterrupted run's. The newest
record of each fault is kept in docs/measurements/recovery.json, and the table between the
page's `recovery` markers is rewritten from that file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "runs" / "cluster-recovery.jsonl"
KEPT = ROOT / "docs" / "measurements" / "recovery.json"
PAGE = ROOT / "docs" / "guides" / "multi-node.md"
BEGIN, END = "<!-- recovery:begin (scripts/recovery_table.py) -->", "<!-- recovery:end -->"


def newest(rows: list[dict]) -> list[dict]:
    """The last record of each (fault, launcher), in the order the faults were first seen."""
    out: dict = {}
    for row in rows:
        out[(row["fault"], row["launcher"])] = row
    return list(out.values())


def _s(x) -> str:
    return "-" if x is None else f"{x:.0f} s" if x >= 10 else f"{x:.1f} s"


def table(rows: list[dict]) -> str:
    lines = ["| fault | launcher | named after | training again after | steps trained twice | "
             "final loss (uninterrupted) | measured on |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        final = "-" if not r.get("final_loss") else f"{r['final_loss'][0]:.4f} ({r['final_loss'][1]:.4f})"
        extra = f"; re-admitted {_s(r['readmitted'])} after it returned" if r.get("readmitted") is not None else ""
        lines.append(f"| {r['fault']} | {r['launcher']} | {_s(r['named_s'])} | {_s(r['training_s'])}{extra} | "
                     f"{'-' if r.get('steps_lost') is None else r['steps_lost']} | {final} | "
                     f"{r.get('cores', '?')} cores, {r.get('when', '?')} |")
    return "\n".join(lines)


def page_with(text: str, rows: list[dict]) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table(rows)}\n{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, default=RECORDS)
    ap.add_argument("--check", action="store_true", help="exit 1 when the page's table is not the kept records'")
    args = ap.parse_args()
    text = PAGE.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{PAGE} has no {BEGIN} ... {END} markers")
    if args.check:
        kept = json.loads(KEPT.read_text())
        ok = page_with(text, kept) == text
        print("the recovery table is the records'" if ok else f"{PAGE}: its recovery table is not {KEPT}'s; "
              "run python scripts/recovery_table.py")
        return 0 if ok else 1
    fresh = [json.loads(x) for x in args.records.read_text().splitlines() if x.strip()]
    kept = json.loads(KEPT.read_text()) if KEPT.exists() else []
    rows = newest([*kept, *fresh])
    KEPT.write_text(json.dumps(rows, indent=1) + "\n")
    PAGE.write_text(page_with(text, rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
