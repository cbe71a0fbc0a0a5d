"""Write the embedded data files under data_recipes/data/ from workbench.data.arith.

    python scripts/make_data.py          # (re)write the files
    python scripts/make_data.py --check  # exit 1 if a shipped file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.data import arith  # noqa: E402

OUT = ROOT / "data_recipes" / "data"
N_TRAIN = 4000
N_EVAL = 200


def files() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for task in arith.TASKS:
        train, held_out = arith.split_pairs(task, N_EVAL)
        op = arith.TASKS[task][2]
        out[f"arith_{task}_eval.jsonl"] = [arith.eval_example(a, b, op) for a, b in held_out]
        if task == "add2":
            out[f"arith_{task}_train.jsonl"] = [arith.chat_example(a, b, op) for a, b in train[:N_TRAIN]]
    return out


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    stale = []
    for name, rows in files().items():
        path, text = OUT / name, render(rows)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale data files (run scripts/make_data.py):", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
