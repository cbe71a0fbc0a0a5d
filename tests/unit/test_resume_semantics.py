"""What a resume records is what it ran: an allowed change applies from the resumed step, a raised
train.max_steps under a decaying schedule is listed as the change it is, and train.resume=never
starts a new run instead of appending to the old one. Each test reads the per-step lr the run
logged (metrics.jsonl) against what manifest.json and report.md claim.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_resume_semantics.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose, train
from workbench.checkpoints import checkpoint
from workbench.compute.optim import lr_factor
from workbench.core.errors import UserError
from workbench.telemetry.compare import read_run

COSINE = ["optim.scheduler=cosine", "optim.warmup_steps=0", "optim.min_lr_ratio=0.1"]


def _rows(out) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "eval" not in r]


def _changes(out) -> dict:
    return json.loads((out / "manifest.json").read_text())["resume"]["changes"]


def test_an_allowed_lr_change_applies_from_the_resumed_step(tmp_path, capsys):
    out, ref = tmp_path / "run", tmp_path / "ref"
    train(["train.max_steps=2"], out)
    train(["train.max_steps=4", "optim.lr=1e-3", "train.resume_changes=allow"], out)
    changes = _changes(out)
    (lr_change,) = [c for c in changes["result"] if c["key"] == "optim.lr"]
    assert (lr_change["before"], lr_change["now"], changes["since"]) == (2e-4, 1e-3, "step-00000002")
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # the constant schedule: each step at the value the records say it ran under
        claimed = lr_change["before"] if r["step"] <= 2 else lr_change["now"]
        assert r["lr"] == pytest.approx(claimed, rel=1e-9), r
    assert changes["from_step"] == 3  # and the records name the step the change applies from
    err = capsys.readouterr().err
    assert "optim.lr 0.0002 -> 0.001 (train.resume_changes=allow; steps 1-2 ran with the earlier values, steps 3-4 " \
           "with these" in err, err
    assert "steps 1-2 ran with the earlier values, steps 3-4 with these" in (out / "report.md").read_text()
    # the new value is what the step computes with: step 3 starts from the same weights as an
    # unchanged run (same loss), step 4 from weights the larger lr moved further
    train(["train.max_steps=4"], ref)
    same = _rows(ref)
    assert rows[2]["loss"] == same[2]["loss"] and rows[3]["loss"] != same[3]["loss"]


def test_raising_max_steps_under_cosine_is_a_listed_change_and_the_schedule_is_recomputed(tmp_path, capsys):
    out = tmp_path / "run"
    train([*COSINE, "train.max_steps=4"], out)
    with pytest.raises(UserError, match=r"this run changes train\.max_steps 4 -> 8 \(optim\.scheduler=cosine spreads "
                                        r"its decay over train\.max_steps"):
        train([*COSINE, "train.max_steps=8"], out)
    train([*COSINE, "train.max_steps=8", "train.resume_changes=allow"], out)
    changes = _changes(out)
    assert {"key": "train.max_steps", "before": 4, "now": 8} in changes["result"] and changes["from_step"] == 5
    assert "the LR schedule is recomputed over train.max_steps=8 from step 5" in capsys.readouterr().err
    assert "the LR schedule is recomputed over train.max_steps=8 from step 5" in (out / "report.md").read_text()
    optim = compose(COSINE).optim
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows:  # steps 1-4 on the 4-step schedule they ran, 5-8 on the 8-step one, as recorded
        length = 4 if r["step"] < changes["from_step"] else 8
        assert r["lr"] == pytest.approx(optim.lr * lr_factor(r["step"] - 1, optim, length), rel=1e-9), r
    # not the old schedule's floor carried into step 5, then a jump
    assert rows[4]["lr"] > rows[3]["lr"]


def test_max_steps_under_a_constant_schedule_changes_no_step(tmp_path):
    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    train(["train.max_steps=3"], out)  # refused under cosine; here each step's lr is the same
    changes = _changes(out)
    assert changes["result"] == [] and {"key": "train.max_steps", "before": 2, "now": 3} in changes["other"]
    assert [r["lr"] for r in _rows(out)] == [2e-4] * 3


def test_resume_never_moves_the_old_run_aside_and_starts_fresh(tmp_path, capsys):
    out = tmp_path / "run"
    train(["train.max_steps=3", "train.checkpoint_every=1"], out)
    train(["train.max_steps=2", "train.resume=never"], out)
    assert [r["step"] for r in _rows(out)] == [1, 2]
    assert [p.name for p in checkpoint._step_dirs(checkpoint.ckpt_root(out))] == ["step-00000002"]
    assert len(read_run(out).rows) == 2  # what `python -m workbench.report` counts
    (old,) = tmp_path.glob("run.old-*")
    assert [r["step"] for r in _rows(old)] == [1, 2, 3]  # the old run, whole, beside it
    assert (old / "checkpoints" / "step-00000003").is_dir() and (old / "report.md").is_file()
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("train.resume=never")]
    assert lines == [f"train.resume=never: {out} held an earlier run; moved it to {old} (nothing deleted) and "
                     "starting a new run there"]
    # an empty or absent directory: nothing to move, nothing said
    train(["train.max_steps=1", "train.resume=never"], tmp_path / "new")
    assert [p.name for p in tmp_path.glob("*.old-*")] == [old.name]
