"""`data.preview=true` for every method family: what each method trains on, rendered through the
template with its trained tokens marked, each sample named by its 1-based file line and its
format, without loading weights.

    python -m pytest -q tests/unit/test_preview.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import compose
from workbench import cli
from workbench.core.errors import UserError
from workbench.models import build, load


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("data.preview loaded model weights")

    for module, name in ((load, "load_model"), (load, "build_meta"), (build, "load_model")):
        monkeypatch.setattr(module, name, refuse)


def rows_file(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def preview(overrides: list[str], tmp_path) -> dict:
    cfg = compose([*overrides, "data.preview=true", f"data.cache_dir={tmp_path / 'cache'}"], tmp_path, validate=False)
    return cli.run_job(cfg)


def marked(text: str) -> list[str]:
    """The spans between ⟦ ⟧: what is trained."""
    return [part.split("⟧")[0] for part in text.split("⟦")[1:]]


def test_sft_names_the_file_line_and_the_detected_format(tmp_path, capsys):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(6)]
    path = rows_file(tmp_path, rows)
    res = preview([f"data.path={path}", "data.preview_samples=3"], tmp_path)
    assert len(res["preview"]) == 3 and capsys.readouterr().out.count("--- sample") == 3
    for sample in res["preview"]:
        line = int(sample["where"].rsplit(":", 1)[1])  # 1-based: line n holds row n-1
        assert sample["where"].startswith(path) and sample["format"] == "messages (detected)"
        assert f"question {line - 1}" in sample["text"] and marked(sample["text"]) == [f"answer {line - 1}<|im_end|>"]


def test_dpo_shows_prompt_chosen_and_rejected(tmp_path, capsys):
    path = rows_file(tmp_path, [
        {"prompt": "What is 2 + 2?", "chosen": "4", "rejected": "five"},
        {"chosen": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}],
         "rejected": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Rome"}]},
        {"prompt": "What is 3 + 3?", "chosen": "6", "rejected": "7"},
    ])
    res = preview(["method=dpo", f"data.path={path}", "data.preview_samples=2"], tmp_path)
    out = capsys.readouterr().out
    first, second = res["preview"]
    assert first["where"] == f"{path}:1" and second["where"] == f"{path}:2"
    assert first["format"] == "preference (detected)" and "shared start" in second["format"]
    assert "What is 2 + 2?" in first["text"] and not marked(first["text"])  # the prompt is context
    assert marked(first["chosen"]) == ["4<|im_end|>"] and marked(first["rejected"]) == ["five<|im_end|>"]
    assert marked(second["chosen"]) == ["Paris<|im_end|>"] and "Capital of France?" in second["text"]
    assert "pairs 3, skipped 0" in out and f"--- pair 1: {path}:1, format preference (detected)" in out
    assert "[chosen]" in out and "[rejected]" in out


def test_rm_shows_pairs_and_their_margin(tmp_path, capsys):
    path = rows_file(tmp_path, [{"prompt": "Say hi", "chosen": "hi", "rejected": "no", "margin": 2.0},
                                {"prompt": "Say yo", "chosen": "yo", "rejected": "hm"}])
    res = preview(["method=rm", f"data.path={path}", "data.preview_samples=2"], tmp_path)
    out = capsys.readouterr().out
    assert [s["where"] for s in res["preview"]] == [f"{path}:1", f"{path}:2"]
    assert "margin 2.0" in out and "reward head reads its last token" in out


def test_kto_shows_unpaired_rows_and_split_pairs(tmp_path, capsys):
    path = rows_file(tmp_path, [
        {"prompt": "What is 1 + 1?", "completion": "2", "label": True},
        {"prompt": "What is 2 + 1?", "chosen": "3", "rejected": "4"},
    ])
    res = preview(["method=kto", f"data.path={path}", "data.preview_samples=3"], tmp_path)
    out = capsys.readouterr().out
    one, chosen, rejected = res["preview"]
    assert one["where"] == f"{path}:1" and one["label"] is True and one["format"] == "unpaired (detected)"
    assert marked(one["text"]) == ["2<|im_end|>"]
    assert chosen["where"] == rejected["where"] == f"{path}:2" and (chosen["label"], rejected["label"]) == (True, False)
    assert "split into a desirable and an undesirable row" in chosen["format"]
    assert marked(rejected["text"]) == ["4<|im_end|>"]
    assert "examples 3, desirable 2, undesirable 1" in out and f"({'undesirable'})" in out


def test_grpo_shows_prompts_their_reward_columns_and_rewards(tmp_path, capsys):
    path = rows_file(tmp_path, [{"prompt": "What is 5 + 5?", "answer": "10"}, {"prompt": "What is 6 + 1?", "answer": "7"}])
    res = preview(["method=grpo", f"data.path={path}", "data.preview_samples=2"], tmp_path)
    out = capsys.readouterr().out
    first = res["preview"][0]
    assert first["where"] == f"{path}:1" and first["format"] == "prompt_only (detected)"
    assert first["columns"] == {"answer": "10"} and first["rewards"] == ["arith_exact", "arith_digits"]
    assert "What is 5 + 5?" in first["text"] and not marked(first["text"])  # the policy writes the completion
    assert "prompts 2" in out and "scored by arith_exact, arith_digits" in out and "8 completions" in out


def test_grpo_env_shows_an_episode_at_its_file_line(tmp_path, capsys):
    res = preview(["method=grpo", "env=calc", "data.preview_samples=1"], tmp_path)
    sample = res["preview"][0]
    assert sample["row"].endswith("calc_grpo_train.jsonl:1") and sample["turns"] >= 1 and marked(sample["text"])
    assert "format prompt_only" in capsys.readouterr().out


def test_a_row_training_refuses_stops_the_preview_at_its_line(tmp_path):
    path = rows_file(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                {"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(UserError, match=r"rows.jsonl:2: not a preference row"):
        preview(["method=dpo", f"data.path={path}"], tmp_path)


def test_bad_rows_skipped_by_training_are_skipped_in_the_preview(tmp_path):
    path = rows_file(tmp_path, [{"messages": []}, {"prompt": "a", "chosen": "b", "rejected": "c"}])
    res = preview(["method=dpo", f"data.path={path}", "data.on_bad_row=skip"], tmp_path)
    assert [s["where"] for s in res["preview"]] == [f"{path}:2"] and res["sources"]
