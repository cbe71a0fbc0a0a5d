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


def test_a_run_whose_groups_all_score_alike_stops_with_the_stall_report(tmp_path, capsys):
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
    # the stop says what happened, what it means and what to try, in one line
    assert "no gradient signal for 3 steps in a row (in every group the completions all scored the same, so every " \
           "advantage was 0); try more generations per prompt (method.num_generations)" in stalled["reason"]
    err = capsys.readouterr().err
    stop_lines = [line for line in err.splitlines() if line.startswith("stopped at step 4: no gradient signal")]
    assert len(stop_lines) == 1 and "method.temperature" in stop_lines[0]
    assert len([line for line in err.splitlines() if line.startswith("warning: ") and "reward spread" in line]) == 1
    assert "; 1 of 4 steps had reward spread" in err  # the run's `done:` line
    assert "- reward spread: 1 of 4 steps had groups with reward spread" in report
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


def test_a_stall_is_warned_about_once_not_every_few_steps():
    watch = StallWatch(stop_after=0, warn_after=2, watched=("reward_std",), last_step=8)
    warned = []
    for step in range(1, 9):
        watch.after({"step": step, "reward_std": 0.0}, 0.0)
        warned += [step] if watch.warning({"step": step, "reward_std": 0.0}, 0.0) else []
    assert warned == [2]
    # signal again, then another stretch without: warned again, once
    watch.after({"step": 9, "reward_std": 1.0}, 1.0)
    for step in (10, 11, 12):
        watch.after({"step": step, "reward_std": 0.0}, 0.0)
        warned += [step] if watch.warning({"step": step, "reward_std": 0.0}, 0.0) else []
    assert warned == [2, 11]


def test_a_run_shorter_than_the_warning_threshold_warns_at_its_end():
    """debug=fast trains 2 steps, method.stall_warn_steps is 3: a run none of whose steps had
    signal still says so, at its last step, with what it means and what to try."""
    watch = StallWatch(stop_after=10, warn_after=3, watched=("reward_std",), hint="a higher method.temperature",
                       last_step=2)
    lines = []
    for step in (1, 2):
        watch.after({"step": step, "reward_std": 0.0}, 0.0)
        lines.append(watch.warning({"step": step, "reward_std": 0.0}, 0.0))
    assert lines[0] is None
    assert lines[1].startswith("warning: 2 step(s) in a row had no reward spread in most of the groups trained on "
                               "(100% at step 2): a group whose completions all scored the same has advantages of 0 "
                               "and adds no gradient")
    assert lines[1].endswith("try a higher method.temperature") and "the run stops" not in lines[1]
    # a run whose last steps alone lacked signal is not warned at its end: the threshold stands
    watch = StallWatch(stop_after=10, warn_after=3, watched=(), last_step=4)
    said = []
    for step, sig in enumerate([1.0, 1.0, 0.0, 0.0], 1):
        watch.after({"step": step}, sig)
        said.append(watch.warning({"step": step}, sig))
    assert said == [None] * 4
