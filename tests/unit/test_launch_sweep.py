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


FIXED = ["model=tiny", "launcher=slurm", "+hardware.partition=gpu"] + [f"train.k{i}={i}" for i in range(22)]


def _multirun_yaml(root, typed):
    """The sweep dir's multirun.yaml as Hydra writes it: the command line's overrides as typed."""
    (root / sweep.MULTIRUN_FILE).write_text(json.dumps({"hydra": {"overrides": {"task": typed}}}))


@pytest.mark.parametrize("with_file", [True, False])
def test_a_one_job_sweep_has_no_override_columns_and_lists_the_fixed_ones_once(tmp_path, with_file):
    """One job's overrides.task holds every override, fixed or not: with nothing swept (by the
    command line, or, without multirun.yaml, by differing between jobs) the table has no
    override columns and the overrides are one line above it."""
    if with_file:
        _multirun_yaml(tmp_path, FIXED)
    _job(tmp_path, 0, FIXED, [3.0, 2.0])
    out = sweep.summarize(tmp_path, plot=False)
    assert (out["swept"], out["fixed"]) == ([], FIXED)
    assert next(csv.reader((tmp_path / "sweep_summary.csv").open())) == ["job", "steps", "final_loss", "status", "best"]
    md = (tmp_path / "sweep_summary.md").read_text()
    fixed_line = "Fixed overrides (every job): " + " ".join(f"`{o}`" for o in FIXED)
    assert md.count(fixed_line) == 1 and md.index(fixed_line) < md.index("| job |")
    assert "| job | steps | final_loss | status | best |" in md


def test_the_columns_are_the_keys_the_command_line_swept(tmp_path):
    """A key swept on the command line is a column even when the jobs at hand agree on it (the
    others ran elsewhere); the fixed ones, `+` keys and all, are not."""
    _multirun_yaml(tmp_path, [*FIXED, "optim.lr=1e-4,3e-4", "+peft.r=choice(8,16)", "train.seed=range(0,2)"])
    _job(tmp_path, 0, [*FIXED, "optim.lr=1e-4", "+peft.r=8", "train.seed=0"], [3.0, 2.0])
    _job(tmp_path, 1, [*FIXED, "optim.lr=1e-4", "+peft.r=16", "train.seed=1"], [3.0, 1.0])
    out = sweep.summarize(tmp_path, plot=False)
    assert (out["swept"], out["fixed"]) == (["optim.lr", "+peft.r", "train.seed"], FIXED)
    rows = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert list(rows[0]) == ["job", "optim.lr", "+peft.r", "train.seed", "steps", "final_loss", "status", "best"]
    assert [(r["optim.lr"], r["+peft.r"], r["train.seed"]) for r in rows] == [("1e-4", "8", "0"), ("1e-4", "16", "1")]


def test_an_optuna_sweeps_choices_are_columns(tmp_path):
    """hydra/sweeper=optuna_accuracy: the command line sweeps nothing, the sweeper chose each
    job's values; the keys whose values differ between jobs are the columns."""
    _multirun_yaml(tmp_path, ["model=tiny", "eval=arith"])
    for i, (lr, r) in enumerate([("1.2e-4", "8"), ("4.7e-4", "8"), ("2.2e-4", "32")]):
        _job(tmp_path, i, ["model=tiny", "eval=arith", f"optim.lr={lr}", f"peft.r={r}"], [3.0, 2.0 - i / 10])
    out = sweep.summarize(tmp_path, plot=False)
    assert (out["swept"], out["fixed"]) == (["optim.lr", "peft.r"], ["model=tiny", "eval=arith"])
    rows = list(csv.DictReader((tmp_path / "sweep_summary.csv").open()))
    assert [(r["optim.lr"], r["peft.r"]) for r in rows] == [("1.2e-4", "8"), ("4.7e-4", "8"), ("2.2e-4", "32")]


def test_an_unreadable_multirun_yaml_falls_back_to_what_differs(tmp_path):
    (tmp_path / sweep.MULTIRUN_FILE).write_text("hydra: {overrides: {task: ['a=(']}}")
    _job(tmp_path, 0, ["model=tiny", "optim.lr=1e-4"], [3.0, 2.0])
    _job(tmp_path, 1, ["model=tiny", "optim.lr=3e-4"], [3.0, 1.0])
    assert sweep.summarize(tmp_path, plot=False)["swept"] == ["optim.lr"]
