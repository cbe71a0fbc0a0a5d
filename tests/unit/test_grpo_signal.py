"""GRPO signal accounting, dynamic sampling and the batch shape (method.prompts_per_step).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_grpo_signal.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose, train
from workbench.core.errors import UserError

# Rewards that have no spread within any group for the first FLAT calls, then do.
CALLS = {"n": 0}
FLAT = 1


def flat_then_varied(completions, **kw):
    CALLS["n"] += 1
    if CALLS["n"] <= FLAT:
        return [1.0] * len(completions)
    return [float(i % 2) for i in range(len(completions))]


def always_flat(completions, **kw):
    return [0.5] * len(completions)


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


BASE = ["method=grpo", "peft=lora", "method.num_generations=2", "train.micro_batch_size=4", "train.grad_accum=1",
        "train.max_steps=1",
        "method.max_new_tokens=4", "train.resume=never"]


def test_flat_batch_is_refilled_not_stepped_on(tmp_path):
    CALLS["n"] = 0
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.unit.test_grpo_signal:flat_then_varied"]',
                  "method.dynamic_sampling=true"], out)
    (row,) = _rows(out)
    # the first generation (2 groups) had no spread: dropped and refilled once, so the one
    # optimizer step trains on groups with signal and the share counts what was generated
    assert CALLS["n"] == 2
    assert row["resample_rounds"] == 1 and row["groups_generated"] == 4 and row["groups_dropped"] == 2
    assert row["zero_std_groups"] == 0.5 and row["signal_groups_trained"] == 2
    assert row["grad_norm"] > 0 and row["signal_share"] == 1.0


def test_without_dynamic_sampling_a_flat_batch_carries_no_gradient(tmp_path):
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.unit.test_grpo_signal:always_flat"]', "method.dynamic_sampling=false"], out)
    (row,) = _rows(out)
    assert row["zero_std_groups"] == 1.0 and row["signal_groups_trained"] == 0
    assert row["grad_norm"] == 0.0 and "entropy" in row


def test_a_short_run_without_reward_spread_says_so(tmp_path, capsys):
    """debug=fast's 2 steps, fewer than method.stall_warn_steps (3): every group scored alike, so
    the run trained on nothing; it warns at its end, and its `done:` line and report.md count the
    steps that had reward spread."""
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.unit.test_grpo_signal:always_flat"]', "method.dynamic_sampling=false",
                  "train.max_steps=2"], out)
    assert [r["signal_share"] for r in _rows(out)] == [0.0, 0.0]
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ") and "reward spread" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: 2 step(s) in a row had no reward spread")
    assert "adds no gradient" in warnings[0] and "try more generations per prompt (method.num_generations)" in warnings[0]
    done = next(line for line in err.splitlines() if line.startswith("done: "))
    assert done.endswith("; 0 of 2 steps had reward spread")
    assert "- reward spread: 0 of 2 steps had groups with reward spread" in (out / "report.md").read_text()


def test_refill_is_capped_and_warns(tmp_path, capsys):
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.unit.test_grpo_signal:always_flat"]', "method.dynamic_sampling=true",
                  "method.max_resample_rounds=2", "method.stall_warn_steps=1"], out)
    (row,) = _rows(out)
    assert row["resample_rounds"] == 2 and row["groups_generated"] == 6 and row["zero_std_groups"] == 1.0
    assert "no reward spread" in capsys.readouterr().err


def test_prompts_per_step_sets_the_batch_independently_of_the_micro_batch(tmp_path, capsys):
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.rewards:char_length"]', "method.prompts_per_step=4",
                  "train.micro_batch_size=2"], out)
    err = capsys.readouterr().err
    assert "4 prompts x 2 generations = 8 completions per optimizer step" in err
    assert "4 micro-batches of 2" in err
    # 3 prompts x 2 generations = 6 completions: not whole micro-batches of 4
    with pytest.raises(UserError, match="prompts_per_step"):
        train(BASE + ["method.prompts_per_step=3"], tmp_path / "bad")
    with pytest.raises(UserError, match=r"\[grpo-deepspeed-accum\].*train.grad_accum=2"):  # DeepSpeed counts them itself
        from workbench.resolve import rules

        cfg = compose(BASE + ["method.prompts_per_step=4", "train.micro_batch_size=4", "backend=deepspeed"])
        rules.check(cfg, rules.Env(packages=frozenset({"deepspeed"})))


def test_truncated_completions_take_the_truncated_reward(tmp_path):
    """method.truncated_reward replaces the total of every completion cut at max_new_tokens; the
    reward functions' own means still report what they scored."""
    out = tmp_path / "run"
    train(BASE + ['reward.functions=["tests.unit.test_grpo_signal:always_flat"]', "method.dynamic_sampling=false",
                  "method.truncated_reward=-3.0"], out)
    (row,) = _rows(out)
    stopped = row["stopped_fraction"]
    assert stopped < 1.0  # the random tiny model runs to max_new_tokens: some completions are cut
    assert row["reward"] == pytest.approx(stopped * 0.5 + (1 - stopped) * -3.0)
    assert row["rewards/tests.unit.test_grpo_signal:always_flat/mean"] == pytest.approx(0.5)
    with pytest.raises(UserError, match="method.truncated_reward"):
        train(BASE + ["method.truncated_reward=inf"], tmp_path / "bad")


def test_a_negative_stall_threshold_is_refused(tmp_path):
    with pytest.raises(UserError, match="method.stall_warn_steps and method.stall_stop_steps must be >= 0"):
        train(BASE + ["method.stall_warn_steps=-1"], tmp_path / "bad")
