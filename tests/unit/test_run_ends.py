"""How a run begins and ends in words: the lines it ends with, "resuming from step N", a relaunch
of a finished run that trains nothing again, and no run directory left by a dry run or a refused
config.

    python -m pytest -q tests/unit/test_run_ends.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT, TINY, train


def test_a_run_ends_with_its_numbers_and_paths_and_a_relaunch_trains_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    first = train(["eval=arith", "eval.num_samples=4", "eval.batch_size=4", "train.max_steps=2"], out)
    said = capsys.readouterr()
    text = said.out + said.err
    assert f"new run in {out}: single, global batch" in text and "resuming" not in text
    assert "done: 2 steps (step 0 -> 2)" in text and f"loss {first['losses'][0]:.4g} -> " in text
    # accuracy with its interval and the number of questions, from the run's own evaluation
    assert "eval arith_add2/accuracy 0.000 -> 0.000 [0.000, 0.490] (4 questions)" in text
    assert f"run directory: {out} (report.md, results.json, metrics.jsonl)" in text
    assert "export: none (train.export=false); later: python -m workbench.export" in text

    metrics = (out / "metrics.jsonl").read_text()
    again = train(["eval=arith", "eval.num_samples=4", "eval.batch_size=4", "train.max_steps=2"], out)
    said = capsys.readouterr()
    text = said.out + said.err
    assert "resuming from step 2" in text and "already finished" in text and "done:" not in text
    assert "new run" not in text
    assert again == json.loads((out / "results.json").read_text())
    assert (out / "metrics.jsonl").read_text() == metrics  # not a step, not an evaluation more

    train(["eval=arith", "eval.num_samples=4", "eval.batch_size=4", "train.max_steps=3"], out)
    text = "".join(capsys.readouterr())
    assert "resuming from step 2" in text and "done: 1 steps (step 2 -> 3)" in text


def test_a_dry_run_and_a_refused_config_leave_no_run_directory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for extra in (["dry_run=true"], ["train.max_steps=-1"]):
        out = tmp_path / extra[0].split("=")[0]
        proc = subprocess.run([sys.executable, "-m", "workbench", *TINY, *extra, f"output_dir={out}"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == (0 if extra[0] == "dry_run=true" else 2), proc.stderr[-2000:]
        assert not out.exists(), sorted(p.name for p in out.iterdir())
