"""The embedded arithmetic task: questions, answers and the exact-match check.

The shipped files under `data_recipes/data/` are made by `scripts/make_data.py` from these
functions (a test checks they match), so the task is reproducible without any download.
Held-out evaluation pairs never appear in the training files.
"""

from __future__ import annotations

import random

INSTRUCTION = "Answer with the number only."

# task name -> (operand ranges, operator)
TASKS = {
    "add2": ((10, 99), (10, 99), "+"),
    "add3": ((100, 999), (100, 999), "+"),
    "mul1": ((2, 9), (2, 9), "*"),
}


def question(a: int, b: int, op: str) -> str:
    return f"What is {a} {op} {b}? {INSTRUCTION}"


def answer(a: int, b: int, op: str) -> str:
    return str(a + b if op == "+" else a * b)


def all_pairs(task: str) -> list[tuple[int, int]]:
    (lo_a, hi_a), (lo_b, hi_b), _ = TASKS[task]
    return [(a, b) for a in range(lo_a, hi_a + 1) for b in range(lo_b, hi_b + 1)]


def split_pairs(task: str, n_eval: int, seed: int = 7) -> tuple[list, list]:
    """Deterministic (train, held_out) split of the task's operand pairs."""
    pairs = all_pairs(task)
    rng = random.Random(f"{task}-{seed}")
    if len(pairs) > 20000:  # 3-digit: sample rather than enumerate a million pairs
        pairs = rng.sample(pairs, 20000)
    rng.shuffle(pairs)
    n_eval = min(n_eval, len(pairs) // 2)
    return pairs[n_eval:], pairs[:n_eval]


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

