"""The shipped data files are exactly what scripts/make_data.py writes, and held-out pairs stay out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_files_match_generator():
    r = subprocess.run([sys.executable, "scripts/make_data.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_eval_questions_never_in_training_file():
    data = ROOT / "data_recipes" / "data"
    train = {json.loads(line)["messages"][0]["content"] for line in (data / "arith_add2_train.jsonl").open()}
    held = [json.loads(line)["prompt"][0]["content"] for line in (data / "arith_add2_eval.jsonl").open()]
    assert len(held) == 200 and not train.intersection(held)


def test_calc_held_out_questions_never_trained():
    """env=calc's held-out questions appear in none of its training files (the tool episodes, the
    bare answers of the mixed warm start, the GRPO prompts), in either operand order."""
    data = ROOT / "data_recipes" / "data"

    def pairs(path, key):
        out = set()
        for line in (data / path).open():
            row = json.loads(line)
            text = next(m["content"] for m in row[key] if m["role"] == "user")
            a, op, b = text.split("?")[0].split()[-3:]
            out.add((op, *sorted((int(a), int(b)))))
        return out

    held = pairs("calc_eval.jsonl", "prompt")
    assert len(held) == 200
    for path, key in [("calc_sft_train.jsonl", "messages"), ("calc_sft_direct.jsonl", "messages"),
                      ("calc_grpo_train.jsonl", "prompt")]:
        trained = pairs(path, key)
        assert len(trained) >= 1000 and not held & trained, path
