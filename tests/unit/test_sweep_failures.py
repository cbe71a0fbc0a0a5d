"""A multirun goes on past a failed job: the failed job's one error line (secrets redacted) is in
the sweep summary beside it, the other job trains and is summarised, and the command exits 2
with a last `error:` line after the summary. A single run's refusal is unchanged (one line, 2).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_sweep_failures.py
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BASE = ["model=tiny", "precision=fp32", "eval=none", "train.max_steps=2", "train.micro_batch_size=2",
        "train.export=false", "train.plots=false", "train.log_every=1", "data.seq_len=64"]
SECRET = "hf_" + "Q" * 30  # token-shaped: quoted by the error, redacted everywhere it is written


def _cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def test_a_failed_job_is_summarised_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    # job 0 names a metric no task reports (refused by preflight), job 1 is fine
    proc = _cli(["-m", *BASE, f"train.keep_best=loss/{SECRET},null", f"hydra.sweep.dir={sweep}"], tmp_path)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out and SECRET not in out, out[-4000:]
    lines = out.strip().splitlines()
    # the last word is the command's: after the summary, one line naming the failed job
    assert lines[-1].startswith("error: 1 sweep job(s) failed, job 0: train.keep_best="), lines[-3:]
    assert lines[-1].endswith(f"see {sweep / 'sweep_summary.md'}")
    assert out.index("sweep summary:") < out.rindex("error: 1 sweep job(s) failed")

    rows = {r["job"]: r for r in csv.DictReader((sweep / "sweep_summary.csv").open())}
    assert rows["0"]["status"] == "FAILED" and "evaluates nothing" in rows["0"]["error"]
    assert rows["1"]["status"] == "COMPLETED" and rows["1"]["error"] == "" and float(rows["1"]["final_loss"]) > 0
    assert len(json.loads((sweep / "1" / "results.json").read_text())["losses"]) == 2  # the good job trained
    md = (sweep / "sweep_summary.md").read_text()
    assert "2 jobs, 1 failed" in md and "| FAILED |" in md and "- job 0 (train.keep_best=" in md
    job = json.loads((sweep / "0" / "sweep_job.json").read_text())
    assert job["status"] == "FAILED" and job["error"] == rows["0"]["error"]
    written = [p for p in sweep.rglob("*") if p.is_file() and p.suffix in (".json", ".md", ".csv", ".yaml", ".log")]
    assert [p for p in written if SECRET in p.read_text(errors="replace")] == []


@pytest.mark.slow  # the single-run line is held in the default tier by test_typos.py and test_bad_input.py
def test_a_single_run_still_stops_with_one_line(tmp_path):
    proc = _cli([*BASE, "train.keep_best=loss/los"], tmp_path)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "train.keep_best='loss/los'" in errors[0], proc.stdout[-3000:]
    assert "sweep" not in proc.stdout
