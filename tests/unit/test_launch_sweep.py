"""The sweep summary on hand-made job dirs: best-run choice, table contents, plot, and the
output_dir resolver outside a multirun.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_sweep.py
"""

from __future__ import annotations

import csv
import json

import pytest

from workbench.config import schema as config
from workbench.launch import sweep


def _job(root, num, overrides, losses, acc=None, status="COMPLETED"):
    d = root / str(num)
    d.mkdir(parents=True)
    (d / sweep.JOB_FILE).write_text(json.dumps({"output_dir": str(d), "overrides": overrides, "status": status}))
    if losses is not None:
        res = {"losses": losses}
        if acc is not None:
            res["eval_end"] = {"eval/arith_add2/accuracy": acc, "eval/arith_add2/n": 100, "eval_seconds": 1.5}
        (d / "results.json").write_text(json.dumps(res))
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                                 for i, v in enumerate(losses)))


def test_best_by_accuracy_when_jobs_evaluate(tmp_path):
    _job(tmp_path, 0, ["model=tiny", "optim.lr=1e-4"], [3.0, 2.0], acc=0.50)
    _job(tmp_path, 1, ["model=tiny", "optim.lr=3e-4"], [3.0, 1.0], acc=0.25)  # lower loss, worse accuracy
    _job(tmp_path, 2, ["model=tiny", "optim.lr=1e-3"], None, status="FAILED")
    out = sweep.summarize(tmp_path)
    assert (out["metric"], out["mode"], out["best_job"]) == ("eval/arith_add2/accuracy", "max", 0)
    rows = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert list(rows[0]) == ["job", "optim.lr", "steps", "final_loss", "eval/arith_add2/accuracy", "status", "best"]
    assert [(r["optim.lr"], r["final_loss"], r["best"]) for r in rows] == [
        ("1e-4", "2.0", "*"), ("3e-4", "1.0", ""), ("1e-3", "", "")]
    assert rows[2]["status"] == "FAILED"
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "| 0 | 1e-4 | 2 | 2 | 0.5 | COMPLETED | **best** |" in md
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"


def test_best_by_lowest_loss_without_eval_and_explicit_metric(tmp_path):
    _job(tmp_path, 0, ["optim.lr=1e-4"], [3.0, 2.5])
    _job(tmp_path, 1, ["optim.lr=3e-4"], [3.0, 1.5])
    assert sweep.summarize(tmp_path, plot=False)["best_job"] == 1
    assert not (tmp_path / "loss_curves.png").exists()
    # an explicit metric and direction win over the default
    assert sweep.summarize(tmp_path, metric="final_loss", mode="max", plot=False)["best_job"] == 0


def test_job_dir_outside_multirun_is_the_default():
    assert config.job_dir("runs/abc") == "runs/abc"


@pytest.mark.parametrize("n", [1, 5])
def test_plot_handles_one_and_many_jobs(tmp_path, n):
    for i in range(n):
        _job(tmp_path, i, [f"optim.lr={i}"], [2.0, 1.0 + i])
    out = sweep.summarize(tmp_path)
    assert out["best_job"] == 0 and (tmp_path / "loss_curves.png").stat().st_size > 2000
