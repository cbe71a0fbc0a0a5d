"""Reward registry: built-ins, `module:function`, weights, and the errors a bad reward raises.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_rewards.py
"""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from tests.conftest import compose
from tests.rewards import char_length
from tests.tolerances import f32_roundings
from workbench.core.errors import UserError
from workbench.rollout import rewards

PROMPTS = [[{"role": "user", "content": "What is 2 + 3?"}]] * 3
TEXTS = ["5", " 5 ", "The answer is 5."]
IDS = [[1], [1, 2], [1, 2, 3, 4]]


def _score(functions, **cols):
    fns = rewards.resolve(OmegaConf.create({"functions": functions}))
    return rewards.score(fns, PROMPTS, TEXTS, IDS, cols or {"answer": ["5"] * 3}, max_new_tokens=8)


def test_builtins():
    got = _score(["arith_exact", "format", "length", "digits"])
    assert got[:, 0].tolist() == [1.0, 1.0, 0.0]
    assert got[:, 1].tolist() == [1.0, 1.0, 0.0]
    assert got[:, 2].tolist() == [1 - 1 / 8, 1 - 2 / 8, 1 - 4 / 8]
    # "The answer is 5.": 1 digit of 13 non-space characters, in float32
    assert got[0, 3] == 1.0 and float(got[2, 3]) == pytest.approx(1 / 13, rel=f32_roundings(1))


def test_digit_credit_needs_the_answers_length():
    # GRPO's default partial credit: right digits in the right places of a number as long as the answer
    texts = ["119", "118", "191", "8", "1190", "119.", " 109 ", "abc"]
    got = rewards.arith_digits(texts, [119] * len(texts))
    assert got == [1.0, 2 / 3, 1 / 3, 0.0, 0.0, 0.0, 2 / 3, 0.0]
    fns = rewards.resolve(compose(["method=grpo"]).reward)
    assert [(f.name, f.weight) for f in fns] == [("arith_exact", 1.0), ("arith_digits", 0.2)]


def test_weights_and_module_function():
    fns = rewards.resolve(OmegaConf.create({"functions": [{"name": "arith_exact", "weight": 2.0},
                                                          "tests.rewards:char_length"]}))
    assert [f.weight for f in fns] == [2.0, 1.0] and fns[1].fn is char_length


def test_unknown_and_missing_rewards():
    with pytest.raises(UserError, match="unknown reward function 'exactt'.*arith_exact"):
        rewards.resolve(OmegaConf.create({"functions": ["exactt"]}))
    with pytest.raises(UserError, match="cannot import module 'no_such_mod'"):
        rewards.resolve(OmegaConf.create({"functions": ["no_such_mod:f"]}))
    with pytest.raises(UserError, match="needs a reward"):
        rewards.resolve(None)
    with pytest.raises(UserError, match="empty"):
        rewards.resolve(OmegaConf.create({"functions": []}))


def raises_on_long(completions, **_):
    return [len(c) / (0 if len(c) > 5 else 1) for c in completions]


def returns_nan(completions, **_):
    return [1.0, math.nan, 0.0][: len(completions)]


def returns_two(completions, **_):
    return [1.0, 0.0]


def test_bad_reward_functions_name_function_and_sample():
    with pytest.raises(UserError, match=r"'tests.unit.test_rewards:raises_on_long' raised on sample 2 .*The answer"
                                        r".*ZeroDivisionError"):
        _score(["tests.unit.test_rewards:raises_on_long"])
    with pytest.raises(UserError, match=r"'tests.unit.test_rewards:returns_nan' returned nan for sample 1"):
        _score(["tests.unit.test_rewards:returns_nan"])
    with pytest.raises(UserError, match=r"returns_two' returned 2 values for 3 completions"):
        _score(["tests.unit.test_rewards:returns_two"])


def needs_solution(completions, solution, *, tolerance=0.0, **_) -> list[float]:
    """A user's reward reading a `solution` column (tolerance has a default: not a column)."""
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def test_required_columns_are_the_parameters_only_a_row_gives():
    assert rewards.required_columns(rewards.arith_exact) == {"answer"}
    assert rewards.required_columns(rewards.length) == set()  # completion_ids is given, max_new_tokens too
    assert rewards.required_columns(needs_solution) == {"solution"}
    assert rewards.required_columns(char_length) == set()


@pytest.mark.parametrize("held_out", [False, True])
def test_a_prompt_row_without_a_reward_column_stops_the_run_before_weights(tmp_path, monkeypatch, held_out):
    """A row missing a column a reward function requires is named with its file:line before any
    weights load, whether it trains (GRPO's data) or is held out (the `reward` evaluation), not
    at the rollout or evaluation that reaches it."""
    import json

    from workbench.cli import run_job
    from workbench.models import build

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the error was raised")

    monkeypatch.setattr(build, "load_model", refuse)
    rows = [{"prompt": f"Say {i}", "solution": str(i)} for i in range(6)]
    if not held_out:
        del rows[3]["solution"]
    train_file = tmp_path / "prompts.jsonl"
    train_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "Say 9", "solution": "9"}) + "\n" + json.dumps({"prompt": "Say 8"}) + "\n")
    overrides = ["method=grpo", f"data.path={train_file}", "train.max_steps=1",
                 'reward.functions=["tests.unit.test_rewards:needs_solution"]']
    overrides += [f"data.eval_split={held}", "eval.tasks=[reward]"] if held_out else ["eval=none"]
    where = f"{held}:2" if held_out else f"{train_file}:4"
    with pytest.raises(UserError, match=rf"{where}: reward function 'tests.unit.test_rewards:needs_solution' needs "
                                        r"the column\(s\) \['solution'\].*keys: \['prompt'\]"):
        run_job(compose(overrides, tmp_path / "run", validate=False))  # the command line's path: preflight, runner
    if held_out:  # the evaluation reads the first eval.num_samples held-out rows; only those are checked
        with pytest.raises(AssertionError, match="weights were loaded"):
            run_job(compose([*overrides, "eval.num_samples=1"], tmp_path / "run1", validate=False))
