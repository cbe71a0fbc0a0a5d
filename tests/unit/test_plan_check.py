"""The plan checked against the run (workbench/plan/check.py), and calibration.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_plan_check.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose, train
from workbench.plan import check as plan_check
from workbench.plan.make import make_plan


def test_a_run_compares_its_measurements_with_the_plan_and_calibrates_later_dry_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_check, "table_path", lambda: tmp_path / "calibration.json")
    res = train(["train.max_steps=3", "plan.check_after_steps=3", "plan.calibrate=true"], tmp_path / "run")
    check = res["plan_check"]
    assert check["steps"] == 3 and set(check["figures"]) == {"peak_gib", "step_seconds", "tokens_per_s"}
    for f in check["figures"].values():
        assert f["predicted"] > 0 and f["measured"] > 0
        assert f["ratio"] == pytest.approx(f["measured"] / f["predicted"])
    assert check["off"] == [k for k, f in check["figures"].items() if abs(f["ratio"] - 1) > plan_check.TOLERANCE]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the first step is left out (it compiles), and on CPU the check's step, run under the profiler
    steps = [r for r in rows if "step_seconds" in r][1:]
    assert [r["step"] for r in steps] == [2, 3]
    assert check["figures"]["tokens_per_s"]["measured"] == pytest.approx(steps[0]["tokens_per_s"])
    assert "Plan check after 3 steps" in (tmp_path / "run" / "report.md").read_text()
    assert json.loads((tmp_path / "run" / "results.json").read_text())["plan_check"]["steps"] == 3

    # the stored ratios move a later dry run's prediction onto what was measured
    cfg = compose([])
    raw = make_plan(cfg, others=False, calibrated=False)["here"]
    cal = make_plan(cfg, others=False)["here"]
    ratios = check["stored"]
    assert cal["calibrated"]["peak_gib"] == ratios["peak_gib"] == check["figures"]["peak_gib"]["ratio"]
    # peak_gb is rounded to 0.005 GiB before and after the ratio is applied
    assert cal["peak_gb"] == pytest.approx(raw["peak_gb"] * ratios["peak_gib"], abs=0.005 * (ratios["peak_gib"] + 1))
    assert cal["tokens_per_s"] == pytest.approx(raw["tokens_per_s"] * ratios["tokens_per_s"])
    measured = check["figures"]["tokens_per_s"]["measured"]
    assert abs(cal["tokens_per_s"] - measured) < abs(raw["tokens_per_s"] - measured)


def test_another_precision_or_model_is_another_entry(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_check, "table_path", lambda: tmp_path / "calibration.json")
    cfg = compose([])
    check = {"figures": {"peak_gib": {"ratio": 2.0}}}
    plan_check.store(cfg.hardware, "fp32", cfg.model.name, check, tmp_path)
    assert plan_check.calibration(cfg.hardware, "fp32", cfg.model.name)["peak_gib"] == 2.0
    assert plan_check.calibration(cfg.hardware, "bf16-mixed", cfg.model.name) is None
    assert plan_check.calibration(cfg.hardware, "fp32", "llama3-70b") is None


def test_off_figures_are_named():
    check = plan_check.compare({"peak_gib": 1.0, "tokens_per_s": 100.0, "step_seconds": None},
                               {"peak_gib": 1.1, "tokens_per_s": 60.0, "step_seconds": 2.0})
    assert set(check["figures"]) == {"peak_gib", "tokens_per_s"} and check["off"] == ["tokens_per_s"]
    assert plan_check.line(check, 10).startswith("warning: plan check after 10 steps")


def test_a_run_faster_than_its_plan_is_no_warning():
    # make run on an AVX2 CPU: step 7.71 s measured against 15.8 s predicted
    faster = plan_check.compare({"step_seconds": 15.8, "tokens_per_s": 50.0, "peak_gib": 1.0},
                                {"step_seconds": 7.71, "tokens_per_s": 102.5, "peak_gib": 1.05})
    assert faster["off"] == ["step_seconds", "tokens_per_s"]
    line = plan_check.line(faster, 10)
    assert not line.startswith("warning") and line.endswith("better than planned by more than 20%: step_seconds, tokens_per_s")
    heavier = plan_check.compare({"step_seconds": 15.8, "peak_gib": 1.0}, {"step_seconds": 7.71, "peak_gib": 1.5})
    line = plan_check.line(heavier, 10)
    assert line.startswith("warning:") and "better than planned by more than 20%: step_seconds" in line
    assert line.endswith("off by more than 20%: peak_gib")


def test_a_cpu_process_far_beyond_its_tensors_is_named():
    # the sp=1 run at 21,504 tokens: 14.15 GiB of tensors, 22.31 resident
    note = plan_check.resident_note(22.31, 14.15, "cpu")
    assert "8.16 beyond its tensors" in note and "MALLOC_MMAP_THRESHOLD_" in note
    check = plan_check.compare({"peak_gib": 16.98}, {"peak_gib": 14.15})
    assert plan_check.line(check, 1, note).endswith(note)
    # the runtime's usual half GiB, a GPU (its allocator's figure is the peak), nothing measured
    assert plan_check.resident_note(6.19, 5.74, "cpu") == ""
    assert plan_check.resident_note(22.31, 14.15, "cuda") == ""
    assert plan_check.resident_note(None, 14.15, "cpu") == ""


DEFAULT_RUN = ["train.max_steps=10", "plan.check_after_steps=10", "train.resume=never", "train.log_every=5"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sft", "grpo"])
def test_the_default_runs_memory_is_what_the_plan_says_on_a_cold_cache(method, tmp_path, monkeypatch):
    """`python -m workbench` and `python -m workbench method=grpo` as shipped (SmolLM2, LoRA,
    precision=auto), the model converted into an empty cache first, as a newcomer's first run
    does: the measured tensor peak is within the plan check's 20% of the prediction. Measured
    when this test was written (2-core AMD EPYC, bf16-mixed): sft 1.00 GiB vs 1.08 (-7%), grpo
    0.595 vs 0.61 (-2%). Step time is not asserted: on a shared machine it is noise."""
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_check, "table_path", lambda: tmp_path / "calibration.json")
    res = train([f"method={method}", *DEFAULT_RUN], tmp_path / "run", base=["eval=none", "train.export=false"])
    peak = res["plan_check"]["figures"]["peak_gib"]
    assert abs(peak["ratio"] - 1) <= plan_check.TOLERANCE, peak
