"""Reward registry: built-ins, `module:function`, weights, and the errors a bad reward raises.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_rewards.py
"""

from __future__ import annotations


def char_length(completions, **_) -> list[float]:
    """A reward with spread on a random model's text (used by the grpo golden curves)."""
    return [len(c) / 50.0 for c in completions]


import math  # noqa: E402

import pytest  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from workbench.errors import UserError  # noqa: E402
from workbench.rollout import rewards  # noqa: E402

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
    assert got[0, 3] == 1.0 and 0 < got[2, 3] < 0.2


def test_weights_and_module_function():
    fns = rewards.resolve(OmegaConf.create({"functions": [{"name": "arith_exact", "weight": 2.0},
                                                          "tests.unit.test_rewards:char_length"]}))
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
