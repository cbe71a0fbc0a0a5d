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

from workbench.data import arith, calc  # noqa: E402

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
    out.update(alignment_files())
    out.update(calc.files())  # env=calc: held-out questions, GRPO prompts, tool-use demonstrations
    return out


N_PREF = 2000
N_PROMPTS = 2000
RAMBLE = (
    "Sure! Let me work that out. {q} equals {ans}. So the answer is {ans}.",
    "Great question! Adding the numbers gives {ans}. I hope this helps!",
    "The answer to {q} is {ans}. Let me know if you have any other questions.",
)


def preference_example(a: int, b: int, op: str, rng) -> dict:
    """A DPO pair on 2-digit addition: the bare correct number against a wrong number or a rambling answer."""
    ans = arith.answer(a, b, op)
    if rng.random() < 0.5:
        wrong = int(ans) + rng.choice((-10, -2, -1, 1, 2, 10))
        rejected = str(wrong)
    else:
        rejected = rng.choice(RAMBLE).format(q=f"{a} {op} {b}", ans=ans)
    return {"prompt": [{"role": "user", "content": arith.question(a, b, op)}], "chosen": ans, "rejected": rejected}


def alignment_files() -> dict[str, list[dict]]:
    """DPO pairs and GRPO prompts from the add2 training pairs; held-out pairs only in *_eval files."""
    import random

    train, held_out = arith.split_pairs("add2", N_EVAL)
    op = arith.TASKS["add2"][2]
    rng = random.Random("arith-pref")
    return {
        "arith_dpo_train.jsonl": [preference_example(a, b, op, rng) for a, b in train[:N_PREF]],
        "arith_pref_eval.jsonl": [preference_example(a, b, op, rng) for a, b in held_out],
        "arith_grpo_train.jsonl": [arith.eval_example(a, b, op) for a, b in train[-N_PROMPTS:]],
    }


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
