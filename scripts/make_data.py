"""Write the embedded data files under data_recipes/data/ from workbench.data.arith, .calc and .needle.

    python scripts/make_data.py          # (re)write the files
    python scripts/make_data.py --check  # exit 1 if a shipped file differs from what it would write,
                                         # or two roles share a question (arith.role_overlaps)
                                         # or a station (needle.role_overlaps)

Roles follow the file name (arith.py's docstring): *_eval.jsonl is the test split,
*_validation.jsonl the validation split, everything else trains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.data import arith, calc, needle  # noqa: E402

OUT = ROOT / "data_recipes" / "data"
N_TRAIN = 4000


def files() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    calc_splits = calc.splits()
    # The calculator's 3-digit sums are worded like arith_add3's: keep its questions out of both.
    calc_keys = frozenset(arith.canonical(calc.question(*t)) for rows in calc_splits.values() for t in rows)
    for task in arith.TASKS:
        s = arith.splits(task, exclude=calc_keys if task == "add3" else ())
        op = arith.TASKS[task][2]
        out[f"arith_{task}_eval.jsonl"] = [arith.eval_example(a, b, op) for a, b in s["test"]]
        out[f"arith_{task}_validation.jsonl"] = [arith.eval_example(a, b, op) for a, b in s["validation"]]
        if task == "add2":
            out[f"arith_{task}_train.jsonl"] = [arith.chat_example(a, b, op) for a, b in s["train"][:N_TRAIN]]
    out.update(alignment_files())
    out.update(calc.files())  # env=calc: held-out questions, GRPO prompts, tool-use demonstrations
    out.update(needle.files())  # the long-context retrieval task
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
    """DPO pairs and GRPO prompts from add2's training pairs; pairs on its held-out questions only
    in the held-out files."""
    import random

    s = arith.splits("add2")
    op = arith.TASKS["add2"][2]
    rng = random.Random("arith-pref")
    return {
        "arith_dpo_train.jsonl": [preference_example(a, b, op, rng) for a, b in s["train"][:N_PREF]],
        "arith_pref_eval.jsonl": [preference_example(a, b, op, rng) for a, b in s["test"]],
        "arith_pref_validation.jsonl": [preference_example(a, b, op, rng) for a, b in s["validation"]],
        "arith_grpo_train.jsonl": [arith.eval_example(a, b, op) for a, b in s["train"][-N_PROMPTS:]],
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
    overlaps = arith.role_overlaps(OUT)
    for a, b, n, example in overlaps:
        print(f"{a} ({arith.role_of(a)}) and {b} ({arith.role_of(b)}) share {n} questions, e.g. {example}")
    stations = needle.role_overlaps(OUT)
    for a, b, n in stations:
        print(f"{a} and {b} share {n} stations")
    return 1 if stale or overlaps or stations else 0


if __name__ == "__main__":
    raise SystemExit(main())
