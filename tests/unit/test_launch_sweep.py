"""The sweep summary on hand-made job dirs: best-run choice, table contents, plot, and the
output_dir resolver inside and outside a multirun.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_sweep.py
"""

from __future__ import annotations

import copy
import csv
import json

import pytest
from matplotlib.colors import to_hex

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


def test_best_by_accuracy_when_jobs_evaluate(tmp_path, saved_figures):
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
    # a panel per job, each with its own curve; the best job's in red, the failed job's empty
    panels = saved_figures["loss_curves.png"]["axes"]
    assert [[(xs, ys) for _, xs, ys, _ in p] for p in panels[:3]] == [[([1, 2], [3.0, 2.0])], [([1, 2], [3.0, 1.0])], []]
    assert [p[0][3] for p in panels[:2]] == [to_hex("tab:red"), to_hex("tab:blue")]
    _png_is(tmp_path / "loss_curves.png", saved_figures)


def test_best_by_lowest_loss_without_eval_and_explicit_metric(tmp_path):
    _job(tmp_path, 0, ["optim.lr=1e-4"], [3.0, 2.5])
    _job(tmp_path, 1, ["optim.lr=3e-4"], [3.0, 1.5])
    assert sweep.summarize(tmp_path, plot=False)["best_job"] == 1
    assert not (tmp_path / "loss_curves.png").exists()
    # an explicit metric and direction win over the default
    assert sweep.summarize(tmp_path, metric="final_loss", mode="max", plot=False)["best_job"] == 0


def test_job_dir_is_the_sweep_subdir_in_a_multirun_and_the_default_otherwise(tmp_path):
    """conf/train.yaml's output_dir is ${workbench.job_dir:runs/<time>}: in a multirun the job's own
    sweep subdir (Hydra's runtime.output_dir), in a single run the default."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from tests.conftest import CONF, TINY

    assert not HydraConfig.initialized()
    assert config.job_dir("runs/abc") == "runs/abc"
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        composed = hydra_compose(config_name="train", overrides=list(TINY), return_hydra_config=True)
    try:
        for mode in (RunMode.MULTIRUN, RunMode.RUN):
            cfg = copy.deepcopy(composed)
            with open_dict(cfg):
                cfg.hydra.mode = mode
                cfg.hydra.runtime.output_dir = str(tmp_path / "7")
            HydraConfig.instance().set_config(cfg)
            if mode == RunMode.MULTIRUN:
                assert config.job_dir("runs/abc") == str(tmp_path / "7")
                assert cfg.output_dir == str(tmp_path / "7")  # the job's config reads it through the resolver
            else:
                assert config.job_dir("runs/abc") == "runs/abc"
                assert cfg.output_dir.startswith("runs/")  # runs/<time>
    finally:
        HydraConfig.instance().cfg = None


@pytest.mark.parametrize("n", [1, 5])
def test_plot_handles_one_and_many_jobs(tmp_path, n, saved_figures):
    for i in range(n):
        _job(tmp_path, i, [f"optim.lr={i}"], [2.0, 1.0 + i])
    out = sweep.summarize(tmp_path)
    assert out["best_job"] == 0
    panels = saved_figures["loss_curves.png"]["axes"]
    assert [[ys for _, _, ys, _ in p] for p in panels[:n]] == [[[2.0, 1.0 + i]] for i in range(n)]
    assert all(not p for p in panels[n:])  # the grid's spare panels are left empty
    _png_is(tmp_path / "loss_curves.png", saved_figures)


def _png_is(path, saved_figures) -> None:
    """The PNG has the pixel size of the figure saved to it and is not blank."""
    from tests.conftest import png_pixels

    pixels = png_pixels(path)
    assert pixels.shape[:2] == saved_figures[path.name]["pixels"]
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[2])[::7].tolist()}) > 10  # not one colour


def test_a_failed_job_is_listed_with_its_error(tmp_path):
    """The CLI records a failed multirun job in error.json (workbench/cli.py); the summary marks it
    FAILED with its error, and a clean sweep's table has no error column."""
    _job(tmp_path, 0, ["optim.lr=1e-4"], [3.0, 2.0])
    _job(tmp_path, 1, ["optim.lr=-1"], None)
    sweep.record_error(tmp_path / "1", "optim.lr=-1: must be > 0\n(the learning rate)")
    out = sweep.summarize(tmp_path, plot=False)
    assert (out["best_job"], out["failed"]) == (0, [1])
    rows = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert [(r["status"], r["error"]) for r in rows] == [
        ("COMPLETED", ""), ("FAILED", "optim.lr=-1: must be > 0 (the learning rate)")]
    md = (tmp_path / "sweep_summary.md").read_text()
    assert "2 jobs, 1 failed" in md and "- job 1 (optim.lr=-1): optim.lr=-1: must be > 0 (the learning rate)" in md
    (tmp_path / "1" / sweep.ERROR_FILE).unlink()
    (tmp_path / "1" / sweep.JOB_FILE).write_text(json.dumps({"overrides": ["optim.lr=-1"], "status": "COMPLETED"}))
    sweep.summarize(tmp_path, plot=False)
    assert "error" not in next(csv.reader((tmp_path / "sweep_summary.csv").open()))
