"""Bad input gets one clear line naming the problem, raised before any weights load."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, compose
from workbench.cli import run_job
from workbench.core.errors import UserError
from workbench.models import build


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the error was raised")

    monkeypatch.setattr(build, "load_model", refuse)


def recipe(tmp_path, body: str, fmt: str = "messages"):
    data = tmp_path / "rows.jsonl"
    data.write_text(body)
    r = tmp_path / "r.yaml"
    r.write_text(f"name: r\nsources:\n  - path: rows.jsonl\n    format: {fmt}\n")
    return str(r)


def run(overrides, tmp_path):
    cfg = compose(overrides, tmp_path, validate=False)
    return run_job(cfg)


def test_missing_data_file(tmp_path):
    r = tmp_path / "r.yaml"
    r.write_text("name: r\nsources:\n  - path: nowhere.jsonl\n")
    with pytest.raises(UserError, match=r"data file not found: .*nowhere.jsonl"):
        run([f"data.recipe={r}"], tmp_path)


def test_unknown_recipe_lists_choices(tmp_path):
    with pytest.raises(UserError, match=r"data.recipe='nope'.*arith_sft"):
        run(["data.recipe=nope"], tmp_path)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    good = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'
    r = recipe(tmp_path, good + good + '{"messages": [\n')
    with pytest.raises(UserError, match=r"rows.jsonl:3: malformed JSON"):
        run([f"data.recipe={r}"], tmp_path)


def test_row_missing_messages(tmp_path):
    r = recipe(tmp_path, '{"text": "hello"}\n')
    with pytest.raises(UserError, match=r"rows.jsonl:1: row has no 'messages' field"):
        run([f"data.recipe={r}"], tmp_path)


def test_unknown_model_name(tmp_path):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=r"(?s)model/gpt-17.*Available options"):
        run(["model=gpt-17"], tmp_path)


def test_unreachable_hub_id_fails_fast(tmp_path):
    with pytest.raises(UserError, match=r"llama3-8b: weights not found.*unreachable"):
        run(["model=llama3-8b", "hardware.memory_gb=1000"], tmp_path)  # so the planner lets it through


def test_lora_target_absent_from_model(tmp_path):
    with pytest.raises(UserError, match=r"peft.target_modules: \['qkv_proj'\] not in the model.*q_proj"):
        run(["peft=lora", "peft.target_modules=[qkv_proj]"], tmp_path)


@pytest.mark.parametrize("held_out_label", [True, False])
def test_kto_held_out_rows_of_one_label_are_refused(tmp_path, held_out_label):
    """KTO's `preference` evaluation ranks desirable against undesirable held-out examples: a
    held-out set of one kind is refused before the weights load, not at the first evaluation."""
    import json

    def row(i, label):
        return json.dumps({"prompt": f"q{i}", "completion": f"a{i}", "label": label}) + "\n"

    train_file, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_file.write_text("".join(row(i, i % 2 == 0) for i in range(8)))
    held.write_text("".join(row(i, held_out_label) for i in range(3)))
    kind = "desirable" if held_out_label else "undesirable"
    with pytest.raises(UserError, match=rf"'preference' on unpaired held-out rows needs desirable and undesirable "
                                        rf"ones; the 3 held out are all {kind}"):
        run(["method=kto", f"data.path={train_file}", f"data.eval_split={held}", "eval.tasks=[preference]"], tmp_path)


def test_negative_lr(tmp_path):
    with pytest.raises(UserError, match="optim.lr"):
        run(["optim.lr=-0.1"], tmp_path)


def test_cli_prints_one_error_line_and_exits_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "workbench", "model=tiny", "optim.lr=-1", f"output_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: config field 'optim.lr' must be > 0")
    assert "Traceback" not in r.stderr
