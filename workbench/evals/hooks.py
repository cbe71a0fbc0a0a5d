"""Evaluation hooks: what `eval.tasks` can name, run before/after (and every N steps of) training.

- `arith_add2`, `arith_add3`, `arith_mul1`: held-out exact-match accuracy on the embedded
  arithmetic task, greedy, answer-only prompt (data_recipes/data/arith_<task>_eval.jsonl).
- `arith_pref`: held-out preference accuracy, the share of pairs whose chosen completion has a
  higher log-prob than the rejected one (data_recipes/data/arith_pref_eval.jsonl; DPO).
Each returns a dict of metrics plus a few sample completions for the report.
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.data import arith
from workbench.data.recipes import RECIPES_DIR
from workbench.errors import UserError
from workbench.rollout.generate import generate

TASKS = ("arith_add2", "arith_add3", "arith_mul1", "arith_pref")


def eval_rows(task: str, n: int) -> list[dict]:
    path = RECIPES_DIR / "data" / f"{task}_eval.jsonl"
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:n]


def check_tasks(tasks) -> None:
    for t in tasks:
        if t not in TASKS:
            raise UserError(f"eval.tasks: unknown task {t!r}; choose from {list(TASKS)}")


def exact_match(model, tokenizer, contract, task: str, cfg_eval, autocast=None) -> dict:
    rows = eval_rows(task, cfg_eval.num_samples)
    correct, samples = 0, []
    for i in range(0, len(rows), cfg_eval.batch_size):
        chunk = rows[i:i + cfg_eval.batch_size]
        outs = generate(model, tokenizer, [r["prompt"] for r in chunk], cfg_eval.max_new_tokens,
                        contract.end_of_turn_id, autocast=autocast)
        for r, ids in zip(chunk, outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            ok = arith.is_correct(text, r["answer"])
            correct += ok
            if len(samples) < 5:
                samples.append({"prompt": r["prompt"][-1]["content"], "completion": text, "answer": r["answer"],
                                "correct": ok})
    return {f"eval/{task}/accuracy": correct / max(1, len(rows)), f"eval/{task}/n": len(rows),
            "samples": {task: samples}}


def run(model, tokenizer, contract, cfg_eval, autocast=None) -> dict:
    out: dict = {"samples": {}}
    for task in cfg_eval.tasks:
        if task == "arith_pref":
            from workbench.methods.dpo import preference_accuracy

            rows = eval_rows(task, cfg_eval.num_samples)
            out[f"eval/{task}/accuracy"] = preference_accuracy(model, tokenizer, contract, rows, autocast=autocast)
            out[f"eval/{task}/n"] = len(rows)
            continue
        res = exact_match(model, tokenizer, contract, task, cfg_eval, autocast)
        out["samples"].update(res.pop("samples"))
        out.update(res)
    return out
