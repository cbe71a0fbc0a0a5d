"""One-file data: `data.path=FILE` without a recipe, a deterministic held-out split that is never
trained on, and the HH-transcript and question/answer shapes recognised without column mapping.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_path.py
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import compose
from tests.helpers import write_jsonl
from workbench.core.errors import UserError
from workbench.data import chat
from workbench.data.readers import iter_rows
from workbench.data.recipes import load_recipe

HH = "\n\nHuman: {q}\n\nAssistant: {a}\n\nHuman: now say {w}\n\nAssistant: {b}"


@pytest.fixture
def chat_file(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Give the code of item {i}"},
                          {"role": "assistant", "content": f"code {i} end"}]} for i in range(40)]
    return write_jsonl(tmp_path / "chat.jsonl", rows)


def ids_of(source) -> list[int]:
    return [int(re.search(r"code (\d+) end", row["messages"][1]["content"]).group(1)) for _, row in iter_rows(source)]


@pytest.mark.parametrize("split, n_eval", [(0.1, 4), (7, 7)])
def test_split_by_fraction_or_count_is_disjoint_and_deterministic(chat_file, split, n_eval):
    cfg = compose([f"data.path={chat_file}", f"data.eval_split={split}"])
    recipe = load_recipe(cfg.data.recipe)
    train, held = ids_of(recipe.sources[0]), ids_of(recipe.eval_sources[0])
    assert len(held) == n_eval and len(train) == 40 - n_eval
    assert not set(train) & set(held) and set(train) | set(held) == set(range(40))
    again = load_recipe(compose([f"data.path={chat_file}", f"data.eval_split={split}"]).data.recipe)
    assert ids_of(again.eval_sources[0]) == held
    assert held != list(range(n_eval))  # a permutation, not the file's head


def test_an_eval_task_on_data_path_holds_out_five_percent_by_default(chat_file):
    recipe = load_recipe(compose([f"data.path={chat_file}", "eval.tasks=[loss]"]).data.recipe)
    assert len(ids_of(recipe.eval_sources[0])) == 2 and len(ids_of(recipe.sources[0])) == 38
    assert not load_recipe(compose([f"data.path={chat_file}"]).data.recipe).eval_sources  # TINY: eval=none


@pytest.mark.parametrize("method, task", [("sft", "loss"), ("dpo", "preference"), ("grpo", "reward")])
def test_own_data_evaluates_its_held_out_rows_by_default(chat_file, method, task):
    cfg = compose([f"data.path={chat_file}", f"method={method}"], base=[])
    assert list(cfg.eval.tasks) == [task] and load_recipe(cfg.data.recipe).eval_sources
    assert list(compose([f"method={method}"], base=[]).eval.tasks) == ["arith_add2"]  # the embedded default stays


def test_larger_split_holds_out_a_superset(chat_file):
    def held(n):
        return set(ids_of(load_recipe(compose([f"data.path={chat_file}", f"data.eval_split={n}"]).data.recipe)
                          .eval_sources[0]))

    assert held(3) < held(9)


def test_split_file_and_list_of_files(chat_file, tmp_path):
    other = write_jsonl(tmp_path / "more.jsonl", [{"prompt": "hi", "completion": "code 99 end"}])
    ev = write_jsonl(tmp_path / "ev.jsonl", [{"prompt": "x", "completion": "y"}])
    recipe = load_recipe(compose([f"data.path=[{chat_file},{other}]", f"data.eval_split={ev}"]).data.recipe)
    assert [s.path for s in recipe.sources] == [chat_file.resolve(), other.resolve()]
    assert [s.path for s in recipe.eval_sources] == [ev.resolve()]
    assert sum(1 for s in recipe.sources for _ in iter_rows(s)) == 41


def test_eval_rows_never_reach_training_batches(chat_file, tmp_path):
    from workbench.run.runner import Runner

    cfg = compose([f"data.path={chat_file}", "data.eval_split=0.25", "train.micro_batch_size=8"], tmp_path)
    held = set(ids_of(load_recipe(cfg.data.recipe).eval_sources[0]))
    runner = Runner(cfg)
    runner.build()
    seen = set()
    for _ in range(12):  # 96 draws from 30 training rows: every one of them shows up
        batch = runner.method.next_batch(runner.state, runner.backend)
        for micro in batch.micro:
            for row in micro["input_ids"]:
                seen |= {int(x) for x in re.findall(r"code (\d+) end", runner.tokenizer.decode(row))}
    assert seen and not seen & held
    assert seen == set(range(40)) - held


def _trained_text(tokenizer, ids, labels) -> str:
    return tokenizer.decode([i for i, lab in zip(ids, labels) if lab != chat.IGNORE])


def test_hh_transcripts_sft_mask_is_on_assistant_turns_only(tmp_path):
    from workbench.data.pipeline import tokenise_source
    from workbench.models.load import load_tokenizer

    f = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": HH.format(q="name a fruit", a="apple", w="blue", b="BLUE"),
                                             "rejected": HH.format(q="name a fruit", a="apple", w="blue", b="no")}])
    cfg = compose([f"data.path={f}"])
    tok = load_tokenizer(cfg.model)
    contract = chat.setup_tokenizer(tok)
    src = load_recipe(cfg.data.recipe).sources[0]
    ids, labels = tokenise_source(src, tok, contract, cfg.data).examples[0]
    trained = _trained_text(tok, ids, labels)
    assert "apple" in trained and "BLUE" in trained  # both assistant turns of the chosen transcript
    assert "fruit" not in trained and "say" not in trained and "no" not in trained.split()
    assert "name a fruit" in tok.decode(ids)


def test_hh_transcripts_dpo_prompt_is_the_shared_prefix(tmp_path):
    from workbench.data.preference import preference_row

    f = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": HH.format(q="q1", a="a1", w="w", b="good"),
                                             "rejected": HH.format(q="q1", a="a1", w="w", b="bad")}])
    where, row = next(iter(iter_rows(load_recipe(compose([f"data.path={f}"]).data.recipe).sources[0])))
    prompt, chosen, rejected = preference_row(row, where)
    assert [m["role"] for m in prompt] == ["user", "assistant", "user"] and prompt[1]["content"] == "a1"
    assert chosen == [{"role": "assistant", "content": "good"}]
    assert rejected == [{"role": "assistant", "content": "bad"}]


def test_dpo_trains_on_hh_and_sft_on_question_answer(tmp_path):
    from workbench.run.runner import Runner

    hh = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": HH.format(q=f"q{i}", a="a", w="w", b=f"yes {i}"),
                                              "rejected": HH.format(q=f"q{i}", a="a", w="w", b="no")}
                                             for i in range(8)])
    res = Runner(compose([f"data.path={hh}", "method=dpo", "train.max_steps=1"], tmp_path / "dpo")).train()
    assert len(res["losses"]) == 1
    qa = write_jsonl(tmp_path / "gsm.jsonl", [{"question": f"{i} plus 2?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
                                              for i in range(8)])
    res = Runner(compose([f"data.path={qa}", "train.max_steps=1"], tmp_path / "sft")).train()
    assert len(res["losses"]) == 1


def test_question_answer_keeps_the_gsm8k_answer_as_completion(tmp_path):
    from workbench.data.pipeline import tokenise_source
    from workbench.models.load import load_tokenizer

    f = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Tom has 3 apples and buys 2. How many?",
                                              "answer": "3+2=5\n#### 5"}])
    cfg = compose([f"data.path={f}"])
    tok = load_tokenizer(cfg.model)
    contract = chat.setup_tokenizer(tok)
    ids, labels = tokenise_source(load_recipe(cfg.data.recipe).sources[0], tok, contract, cfg.data).examples[0]
    trained = _trained_text(tok, ids, labels)
    assert "3+2=5\n#### 5" in trained and "apples" not in trained


def test_other_shapes_still_name_file_and_line(tmp_path):
    from workbench.data.pipeline import tokenise_source
    from workbench.models.load import load_tokenizer

    f = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}, {"query": "q", "response": "a"}])
    cfg = compose([f"data.path={f}"])
    tok = load_tokenizer(cfg.model)
    with pytest.raises(UserError, match=rf"{re.escape(str(f))}:2: row has no 'prompt' field"):
        tokenise_source(load_recipe(cfg.data.recipe).sources[0], tok, chat.setup_tokenizer(tok), cfg.data)
    broken = write_jsonl(tmp_path / "hh_bad.jsonl", [{"chosen": "\n\nHuman: hi\n\nAssistant: ", "rejected": "x"}])
    with pytest.raises(UserError, match=r"hh_bad.jsonl:1: cannot tell"):
        tokenise_source(load_recipe(compose([f"data.path={broken}"]).data.recipe).sources[0], tok,
                        chat.setup_tokenizer(tok), cfg.data)


@pytest.mark.parametrize("value, match", [("1.5", "between 0 and 1"), ("0", ">= 1"), ("nope.jsonl", "existing file"),
                                          ("40", "nothing to train on")])
def test_bad_eval_split_is_one_line(chat_file, value, match):
    with pytest.raises(UserError, match=match):
        load_recipe(compose([f"data.path={chat_file}", f"data.eval_split={value}"]).data.recipe)


def test_missing_data_file_and_unknown_format_are_named(tmp_path, chat_file):
    with pytest.raises(UserError, match="data.path: data file not found"):
        compose([f"data.path={tmp_path / 'absent.jsonl'}"])
    with pytest.raises(UserError, match="data.format='chatml' is not one of auto, messages"):
        compose([f"data.path={chat_file}", "data.format=chatml"])
    assert load_recipe(compose([f"data.path={chat_file}", "data.format=messages"]).data.recipe).sources[0].format \
        == "messages"


@pytest.mark.parametrize("method, recipe", [("sft", "arith_sft"), ("dpo", "arith_dpo"), ("grpo", "arith_grpo")])
def test_a_split_of_a_named_recipe_splits_the_one_the_method_reads(method, recipe):
    r = load_recipe(compose([f"method={method}", "data.eval_split=10"]).data.recipe)
    assert r.name == recipe and sum(1 for s in r.eval_sources for _ in iter_rows(s)) == 10
