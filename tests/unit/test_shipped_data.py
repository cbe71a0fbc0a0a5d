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
