"""A GRPO run that runs out of gradient says what collapsed and stops (workbench/train/signal.py).

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_grpo_stall.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import train
from workbench.train.signal import StallWatch

CALLS: list[int] = []


def spread_once(completions, **_) -> list[float]:
    """Rewards that vary on the first scoring only (completion lengths), then all alike: every
    group after the first step has no reward spread, refills included."""
    CALLS.append(len(completions))
    if len(CALLS) == 1:
        return [float(len(c)) for c in completions]
    return [1.0] * len(completions)


def test_a_run_whose_groups_all_score_alike_stops_with_the_stall_report(tmp_path):
    CALLS.clear()
    res = train(["method=grpo", "reward.functions=[tests.unit.test_grpo_stall:spread_once]",
                 "method.num_generations=4", "train.micro_batch_size=8", "train.grad_accum=1",
                 "method.max_new_tokens=6", "method.max_resample_rounds=1", "method.stall_warn_steps=2",
                 "method.stall_stop_steps=3", "train.max_steps=12", "train.export=true", "export.parity_prompts=2"],
                tmp_path)
    stalled = res["stalled"]
    # step 1 had spread; steps 2, 3, 4 had none: the run ends at step 4 of 12
    assert (stalled["step"], stalled["last_signal_step"]) == (4, 1)
    assert len(res["losses"]) == 4
    assert "reward_std" in stalled["collapsed"]
    change = next(c for c in stalled["changes"] if c["metric"] == "reward_std")
    assert change["start"] > 0 and change["now"] == 0.0
    # the weights exported are the step-1 checkpoint's, saved before the first step without signal
    assert stalled["exported_from"].endswith("step-00000001")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["zero_std_groups"] for r in rows if "loss" in r][1:] == [1.0, 1.0, 1.0]
    report = (tmp_path / "report.md").read_text()
    assert "Stopped early at step 4" in report and "| reward_std |" in report
    assert json.loads((tmp_path / "results.json").read_text())["stalled"]["step"] == 4
    assert (tmp_path / "export" / "merged" / "model.safetensors").exists()


def test_stop_on_stall_false_trains_every_step(tmp_path):
    CALLS.clear()
    res = train(["method=grpo", "reward.functions=[tests.unit.test_grpo_stall:spread_once]",
                 "method.num_generations=4", "train.micro_batch_size=8", "train.grad_accum=1",
                 "method.max_new_tokens=6", "method.max_resample_rounds=0", "method.stop_on_stall=false",
                 "method.stall_stop_steps=2", "train.max_steps=4"], tmp_path)
    assert "stalled" not in res and len(res["losses"]) == 4


@pytest.mark.parametrize("signals,stop_at", [([1, 0, 0, 0], 4), ([1, 0, 0.5, 0, 0, 0], 6), ([0, 0, 0], 3)])
def test_the_watch_counts_steps_without_any_signal(signals, stop_at):
    watch = StallWatch(stop_after=3, warn_after=2, watched=("completion_length",))
    stopped = None
    for step, (sig, length) in enumerate(zip(signals, [8.0, 4.0, 2.0, 1.0, 1.0, 1.0]), 1):
        stopped = watch.after({"step": step, "completion_length": length}, sig)
        if stopped:
            break
    assert stopped["step"] == stop_at
    assert stopped["changes"][0]["collapsed"] == (stopped["changes"][0]["now"] <= 4.0)


def test_the_warning_names_what_collapsed():
    watch = StallWatch(stop_after=10, warn_after=2, watched=("completion_length", "entropy"), hint="a KL term")
    lines = []
    for step, (length, ent) in enumerate([(7.6, 2.0), (3.0, 1.9), (1.1, 1.8), (1.0, 1.8)], 1):
        sig = 1.0 if step == 1 else 0.0
        watch.after({"step": step, "completion_length": length, "entropy": ent}, sig)
        lines.append(watch.warning({"step": step, "completion_length": length, "entropy": ent}, sig))
    assert lines[:2] == [None, None] and lines[3] is None
    assert "completion length (tokens) 7.6 -> 1.1 (collapsed), entropy (nats/token) 2 -> 1.8" in lines[2]
    assert "try a KL term" in lines[2]
