"""The embedded arithmetic task: questions, answers, the exact-match check, and its split by meaning.

The shipped files under `data_recipes/data/` are made by `scripts/make_data.py` from these
functions (a test checks they match), so the task is reproducible without any download.

Splits are made on the meaning of a question, not its wording. `canonical(text)` reads
"What is a op b?" and returns the operator with its operands sorted ("+:27,64"), because `+` and
`*` are commutative: "What is 27 + 64?" and "What is 64 + 27?" are one question. Each task's
unordered operand pairs are shuffled with a fixed seed and dealt into three roles, by file name:

- test (`*_eval.jsonl`): what the docs report (docs/measurements/learning.md) (`eval.tasks=[arith_add2]`), used for nothing else;
- validation (`*_validation.jsonl`): what defaults and sweeps are chosen on (`eval.tasks=[arith_add2_val]`);
- train (every other file): the SFT rows, the DPO/KTO/ORPO/RM pairs and the GRPO prompts together,
  in either operand order. A preference row belongs to the question it is about.

The 3-digit pairs also avoid every pair the calculator task uses (`calc.py`), whose questions
read the same. `role_overlaps` checks all of this on a directory of files; `row_key` applies the
same canonical form to a user's own file (`data.eval_split` with `data.dedup_key`).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

INSTRUCTION = "Answer with the number only."

# task name -> (operand ranges, operator)
TASKS = {
    "add2": ((10, 99), (10, 99), "+"),
    "add3": ((100, 999), (100, 999), "+"),
    "mul1": ((2, 9), (2, 9), "*"),
}
# task name -> (test, validation) sizes in unordered pairs; mul1 has only 36 pairs in all
HELD_OUT = {"add2": (200, 200), "add3": (200, 200), "mul1": (24, 12)}
ROLES = ("train", "validation", "test")

_EXPR = re.compile(r"What is (\d+(?: [+*] \d+)+)\?")


def question(a: int, b: int, op: str) -> str:
    return f"What is {a} {op} {b}? {INSTRUCTION}"


def answer(a: int, b: int, op: str) -> str:
    return str(a + b if op == "+" else a * b)


def canonical(text: str) -> str:
    """The question's meaning: "op:operands" sorted for an arithmetic question, else the text
    with whitespace collapsed."""
    m = _EXPR.search(text)
    if m:
        parts = m.group(1).split()
        ops = set(parts[1::2])
        if len(ops) == 1:  # one commutative operator throughout: order does not matter
            return f"{ops.pop()}:{','.join(map(str, sorted(int(x) for x in parts[0::2])))}"
    return " ".join(text.split())


def _unordered(task: str, exclude: frozenset, n: int) -> list[tuple[int, int]]:
    """The task's unordered operand pairs (a <= b) not in `exclude`, in a fixed order; 3-digit
    pairs are sampled (there are 405,450), the others enumerated."""
    (lo, hi), _, op = TASKS[task]
    rng = random.Random(f"arith-{task}")
    if hi - lo > 200:
        seen: set = set()
        while len(seen) < n:
            a, b = sorted((rng.randint(lo, hi), rng.randint(lo, hi)))
            if canonical(question(a, b, op)) not in exclude:
                seen.add((a, b))
        pairs = sorted(seen)
    else:
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)
                 if canonical(question(a, b, op)) not in exclude]
    rng.shuffle(pairs)
    return pairs


def splits(task: str, exclude=frozenset()) -> dict[str, list[tuple[int, int]]]:
    """{"test", "validation", "train"}: ordered operand pairs, no unordered pair in two roles.

    Held-out roles show each pair once, in a random order of its operands; train holds both
    orders of every remaining pair, shuffled (empty for add3, which trains nothing)."""
    n_test, n_val = HELD_OUT[task]
    pairs = _unordered(task, frozenset(exclude), n_test + n_val)
    rng = random.Random(f"arith-{task}-orient")
    held = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs[:n_test + n_val]]
    train = [] if task == "add3" else [o for a, b in pairs[n_test + n_val:] for o in {(a, b), (b, a)}]
    train.sort()  # the set above has no fixed order
    rng.shuffle(train)
    return {"test": held[:n_test], "validation": held[n_test:], "train": train}


def chat_example(a: int, b: int, op: str) -> dict:
    return {"messages": [
        {"role": "user", "content": question(a, b, op)},
        {"role": "assistant", "content": answer(a, b, op)},
    ]}


def eval_example(a: int, b: int, op: str) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b, op)}], "answer": answer(a, b, op)}


def is_correct(completion: str, expected: str) -> bool:
    """Exact match: the completion, stripped, is the number and nothing else."""
    return completion.strip() == expected


def row_key(row: dict) -> str:
    """A row's canonical question, for `data.dedup_key=workbench.data.arith:row_key`: held-out
    questions then leave training in either operand order."""
    return canonical(question_of(row))


def role_of(file_name: str) -> str:
    if file_name.endswith("_eval.jsonl"):
        return "test"
    if file_name.endswith("_validation.jsonl"):
        return "validation"
    return "train"


def question_of(row: dict) -> str:
    """The question a shipped row is about: its first user message (chat rows, prompt rows and
    preference pairs alike)."""
    msgs = row.get("messages") or row.get("prompt")
    if isinstance(msgs, str):
        return msgs
    return next(m["content"] for m in msgs if m["role"] == "user")


def role_overlaps(data_dir) -> list[tuple[str, str, int, str]]:
    """Every pair of files in different roles that share a canonical question:
    (file, other file, how many, one example). Empty when the roles are disjoint."""
    keys: dict[str, set] = {}
    for path in sorted(Path(data_dir).glob("*.jsonl")):
        keys[path.name] = {canonical(question_of(json.loads(line))) for line in path.open() if line.strip()}
    out = []
    names = sorted(keys)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if role_of(a) != role_of(b):
                shared = keys[a] & keys[b]
                if shared:
                    out.append((a, b, len(shared), min(shared)))
    return out
