"""data.dedup_key: a held-out row's twins (the same prompt by default, the same key from the
user's `module:function` otherwise) never reach training, and a bad key is one line naming it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_dedup_key.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose
from tests.helpers import write_jsonl
from workbench.core.errors import UserError
from workbench.data import arith
from workbench.data.readers import iter_rows
from workbench.data.recipes import load_recipe, prompt_key

SWAPPED = "workbench.data.arith:row_key"


@pytest.fixture
def sums(tmp_path):
    """60 rows: 30 sums, each asked once as a + b and once as b + a."""
    pairs = [(10 + i, 50 + 2 * i) for i in range(30)]
    rows = [arith.chat_example(a, b, "+") for a, b in pairs] + [arith.chat_example(b, a, "+") for a, b in pairs]
    return write_jsonl(tmp_path / "sums.jsonl", rows)


def split(path, held, key=None):
    over = [f"data.path={path}", f"data.eval_split={held}"] + ([f"data.dedup_key={key}"] if key else [])
    recipe = load_recipe(compose(over).data.recipe)
    train = [row for s in recipe.sources for _, row in iter_rows(s)]
    evals = [row for s in recipe.eval_sources for _, row in iter_rows(s)]
    return train, evals


def test_the_key_keeps_swapped_operands_out_of_training(sums):
    train, evals = split(sums, 10, SWAPPED)
    held = {arith.row_key(r) for r in evals}
    assert len(evals) == 10 and not held & {arith.row_key(r) for r in train}
    assert len(train) == 60 - 2 * len(held)  # each held-out sum's other wording left training too


def test_without_a_key_only_the_exact_prompt_is_kept_out(sums, tmp_path):
    train, evals = split(sums, 10)
    assert len(evals) == 10 and not {prompt_key(r) for r in evals} & {prompt_key(r) for r in train}
    assert {arith.row_key(r) for r in evals} & {arith.row_key(r) for r in train}  # swapped twins stay
    twice = write_jsonl(tmp_path / "twice.jsonl", [json.loads(line) for line in sums.open()] * 2)
    train, evals = split(twice, 10)  # exact duplicates: a held-out row's copy is never trained on
    assert not {prompt_key(r) for r in evals} & {prompt_key(r) for r in train}
    assert len(train) == 120 - 2 * len({prompt_key(r) for r in evals})


def test_a_held_out_file_removes_its_twins_from_training(sums, tmp_path):
    held = write_jsonl(tmp_path / "held.jsonl", [arith.eval_example(50, 10, "+"), arith.eval_example(11, 52, "+")])
    train, _ = split(sums, held, SWAPPED)
    assert len(train) == 56 and not {"+:10,50", "+:11,52"} & {arith.row_key(r) for r in train}
    train, _ = split(sums, held)
    assert len(train) == 58  # the two exact prompts only: "50 + 10" and "11 + 52", not "10 + 50" or "52 + 11"
    assert {"+:10,50", "+:11,52"} <= {arith.row_key(r) for r in train}


def test_prompt_key_reads_every_shape_as_its_question():
    q = "What is 2 + 3?"
    assert prompt_key({"prompt": q, "completion": "5"}) == prompt_key({"prompt": [{"role": "user", "content": q}],
                                                                      "chosen": "5", "rejected": "6"}) == q
    assert prompt_key({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "5"}]}) == q
    assert prompt_key({"instruction": q, "output": "5"}) == q
    assert prompt_key({"text": q}) == q


@pytest.mark.parametrize("key, match", [
    ("nosuchpkg.keys:question", r"data.dedup_key: cannot import module 'nosuchpkg.keys'"),
    ("workbench.data.arith:nope", r"data.dedup_key: module 'workbench.data.arith' has no function 'nope'"),
    ("row_key", r"data.dedup_key='row_key': name a function as 'package.module:function'"),
])
def test_a_bad_key_is_one_line_naming_the_field(sums, key, match):
    with pytest.raises(UserError, match=match) as exc:
        compose([f"data.path={sums}", "data.eval_split=10", f"data.dedup_key={key}"])
    assert "\n" not in str(exc.value)


def test_a_key_without_a_split_or_that_raises_is_named(sums):
    with pytest.raises(UserError, match="data.dedup_key='workbench.data.arith:row_key' keeps data.eval_split"):
        compose([f"data.path={sums}", f"data.dedup_key={SWAPPED}"])
    with pytest.raises(UserError, match=r"data.dedup_key='workbench.data.arith:answer' raised on .*sums.jsonl:1: "
                                        "TypeError"):
        split(sums, 10, "workbench.data.arith:answer")
