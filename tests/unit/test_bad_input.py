"""Bad input, table-driven: each malformed config, data row or environment state ends in one
`UserError` naming the field or file:line, before any weights load.

Each case runs in-process through `cli.run_job` (what `python -m workbench` calls after Hydra
composes), so the table stays fast; `test_cli_exit_status` checks, for a few of them, that the
real command line prints one `error:` line, exits 2 and shows no traceback.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_bad_input.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, compose
from workbench.cli import run_job
from workbench.core.errors import UserError
from workbench.models import build

U, A = "user", "assistant"


def chat(*turns) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = chat((U, "1+1="), (A, "2"))
PAIR = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}


def jl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the error was raised")

    monkeypatch.setattr(build, "load_model", refuse)


def write_recipe(tmp_path, body: str, fmt: str = "auto", name: str = "rows.jsonl") -> str:
    (tmp_path / name).write_text(body)
    r = tmp_path / "r.yaml"
    r.write_text(f"name: r\nsources:\n  - path: {name}\n    format: {fmt}\n")
    return str(r)


def run(overrides, tmp_path):
    return run_job(compose(overrides, tmp_path / "out", validate=False))


M = "rows.jsonl"  # the data file every data case writes
T = jl  # rows -> jsonl text


def msg(**m) -> dict:
    return {"messages": [{"role": U, "content": "q"}, {"role": A, "content": "a", **m}]}


# (id, file body, extra overrides, the error must match); the file is rows.jsonl unless the
# body is a (name, text) pair. Each must be a UserError naming the file:line or the field.
DATA_CASES = [
    # chat rows: wrong types inside messages, roles, shapes
    ("content-int", T(chat((U, 42), (A, "2"))), [], r"rows.jsonl:1: messages\[0\]\.content must be a string"),
    ("content-dict", T(chat((U, "q"), (A, {"x": 1}))), [], r"rows.jsonl:1: messages\[1\]\.content must be a string"),
    ("content-float", T(chat((U, "q"), (A, 2.5))), [], r"rows.jsonl:1: messages\[1\]\.content must be a string"),
    ("content-bool", T(chat((U, True), (A, "a"))), [], r"rows.jsonl:1: messages\[0\]\.content must be a string"),
    ("content-null-no-tools", T(chat((U, "q"), (A, None))), [],
     r"rows.jsonl:1: messages\[1\]\.content must be a string"),
    ("content-list-of-ints", T(chat((U, [1, 2]), (A, "a"))), [],
     r"rows.jsonl:1: messages\[0\]\.content must be a string"),
    ("content-int-line-3", T(GOOD, GOOD, chat((U, "q"), (A, 7))), [], r"rows.jsonl:3: messages\[1\]\.content"),
    ("role-missing", T({"messages": [{"content": "q"}, {"role": A, "content": "a"}]}), [],
     r"rows.jsonl:1: messages\[0\] needs 'role'"),
    ("role-unknown", T(chat(("robot", "q"), (A, "a"))), [], r"rows.jsonl:1: messages\[0\] has unknown role 'robot'"),
    ("role-int", T(chat((3, "q"), (A, "a"))), [], r"rows.jsonl:1: messages\[0\] has unknown role 3"),
    ("content-missing", T({"messages": [{"role": U}, {"role": A, "content": "a"}]}), [],
     r"rows.jsonl:1: messages\[0\] needs 'content'"),
    ("messages-string", T({"messages": "hello"}), [], r"rows.jsonl:1: 'messages' must be a non-empty list"),
    ("messages-empty", T({"messages": []}), [], r"rows.jsonl:1: 'messages' must be a non-empty list"),
    ("message-not-dict", T({"messages": ["hi", {"role": A, "content": "a"}]}), [],
     r"rows.jsonl:1: messages\[0\] needs 'role' and 'content'"),
    ("no-assistant-turn", T(chat((U, "q"), (U, "again"))), [], r"rows.jsonl:1: no assistant turn"),
    ("empty-assistant-turn", T(GOOD, chat((U, "q"), (A, "  "))), [], r"rows.jsonl:2: assistant turn 2 is empty"),
    ("tool-call-bad-content", T(msg(tool_calls=[{"type": "function"}], content=5)), [],
     r"rows.jsonl:1: messages\[1\]\.content must be a string"),
    ("mixed-shapes-declared", T(GOOD, {"instruction": "q", "output": "a"}), ["data.recipe_format=messages"],
     r"rows.jsonl:2: row has no 'messages' field"),
    ("mixed-shapes-auto", T(GOOD, {"foo": 1}), [], r"rows.jsonl:2: row has no 'messages' field"),
    # the file itself
    ("malformed-json", T(GOOD, '{"messages": ['), [], r"rows.jsonl:2: malformed JSON"),
    ("row-is-list", T([1, 2]), [], r"rows.jsonl:1: .*(object|dict)"),
    ("row-is-number", T(5), [], r"rows.jsonl:1: .*(object|dict)"),
    ("empty-file", "", [], r"rows.jsonl: empty source"),
    ("blank-lines-only", "\n\n\n", [], r"rows.jsonl: empty source"),
    ("not-utf8", b"\xff\xfe\x00garbage\n", [], r"rows.jsonl.*(UTF-8|utf-8|decode)"),
    ("parquet-garbage", ("rows.parquet", b"this is not parquet"), [], r"rows.parquet.*(parquet|read)"),
    ("json-array-of-strings", ("rows.json", '["a", "b"]'), [], r"rows.json.*(object|dict)"),
    ("csv-missing-column", ("rows.csv", "instruction,input\nq,\n"), ["data.recipe_format=alpaca"],
     r"rows.csv:\d+: row has no 'output' field"),
    # other SFT formats
    ("sharegpt-from-unknown", T({"conversations": [{"from": "alien", "value": "q"}, {"from": "gpt", "value": "a"}]}),
     [], r"rows.jsonl:1: conversations\[0\]\.from='alien'"),
    ("sharegpt-value-int", T({"conversations": [{"from": "human", "value": 1}, {"from": "gpt", "value": "a"}]}),
     [], r"rows.jsonl:1: 'conversations\[0\]\.value' must be a string"),
    ("sharegpt-not-list", T({"conversations": "hi"}), [], r"rows.jsonl:1: 'conversations' must be a non-empty list"),
    ("alpaca-output-int", T({"instruction": "q", "output": 3}), [], r"rows.jsonl:1: 'output' must be a string"),
    ("pc-completion-int", T({"prompt": "q", "completion": 3}), [], r"rows.jsonl:1: .*completion"),
    ("text-empty", T({"text": ""}), [], r"rows.jsonl:1: 'text' is empty"),
    ("text-int", T({"text": 5}), [], r"rows.jsonl:1: 'text' must be a string"),
    ("preference-row-for-sft", T(PAIR), [], r"rows.jsonl:1: format preference rows are for method=dpo/kto/grpo"),
    # DPO
    ("dpo-content-int", T({"prompt": [{"role": U, "content": 5}], "chosen": "2", "rejected": "3"}), ["method=dpo"],
     r"rows.jsonl:1: prompt\[0\]\.content must be a string"),
    ("dpo-missing-rejected", T({"prompt": "q", "chosen": "a"}), ["method=dpo"], r"rows.jsonl:1: not a preference row"),
    ("dpo-chosen-int", T({**PAIR, "chosen": 4}), ["method=dpo"], r"rows.jsonl:1: 'chosen' must be a string"),
    ("dpo-chosen-empty-list", T({**PAIR, "chosen": []}), ["method=dpo"], r"rows.jsonl:1: 'chosen' must be"),
    ("dpo-no-shared-prefix", T({"chosen": [{"role": U, "content": "a"}, {"role": A, "content": "b"}],
                                "rejected": [{"role": U, "content": "c"}, {"role": A, "content": "d"}]}),
     ["method=dpo"], r"rows.jsonl:1: chosen and rejected conversations need a shared prompt"),
    ("dpo-chosen-ends-with-user", T({"prompt": "q", "chosen": [{"role": U, "content": "x"}], "rejected": "r"}),
     ["method=dpo"], r"rows.jsonl:1: 'chosen' must end with an assistant turn"),
    ("dpo-all-identical", T({**PAIR, "rejected": "2"}, {**PAIR, "rejected": "2"}), ["method=dpo"],
     r"rows.jsonl: every pair \(2\) has identical chosen and rejected"),
    ("dpo-sft-rows", T(GOOD), ["method=dpo"], r"rows.jsonl:1: not a preference row"),
    # GRPO
    ("grpo-content-int", T({"prompt": [{"role": U, "content": 9}], "answer": "1"}), ["method=grpo"],
     r"rows.jsonl:1: prompt\[0\]\.content must be a string"),
    ("grpo-no-prompt", T({"question": "q"}), ["method=grpo"], r"rows.jsonl:1: .*prompt"),
    ("grpo-sft-rows", T(GOOD), ["method=grpo"], r"rows.jsonl:1: .*prompt"),
    ("grpo-prompt-ends-assistant", T({"prompt": [{"role": U, "content": "q"}, {"role": A, "content": "a"}]}),
     ["method=grpo"], r"rows.jsonl:1: .*assistant"),
]

@pytest.mark.parametrize("rows,extra,match", [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_bad_data(tmp_path, rows, extra, match):
    name, body = rows if isinstance(rows, tuple) else (M, rows)
    fmt = next((e.split("=", 1)[1] for e in extra if e.startswith("data.recipe_format=")), "auto")
    extra = [e for e in extra if not e.startswith("data.recipe_format=")]
    if isinstance(body, bytes):
        (tmp_path / name).write_bytes(body)
        r = write_recipe(tmp_path, "", fmt, "unused.jsonl").replace("unused.jsonl", name)
        (tmp_path / "r.yaml").write_text((tmp_path / "r.yaml").read_text().replace("unused.jsonl", name))
    else:
        r = write_recipe(tmp_path, body, fmt, name)
    with pytest.raises(UserError, match=match):
        run([f"data.recipe={r}", *extra], tmp_path)


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_on_bad_row_skip_passes_over_malformed_lines_and_counts_them(tmp_path, method):
    good = GOOD if method == "sft" else PAIR
    body = T(good, '{"messages": [', good, chat((U, "q"), (A, "")) if method == "sft" else 7, good)
    r = write_recipe(tmp_path, body)
    with pytest.raises(UserError, match=r"rows.jsonl:2: malformed JSON"):
        run([f"data.recipe={r}", f"method={method}", "eval=none"], tmp_path)
    # skip: the malformed line and the bad row are counted and named, the three good rows remain
    res = run([f"data.recipe={r}", f"method={method}", "eval=none", "data.on_bad_row=skip", "data.preview=true"],
              tmp_path)
    report = res["sources"]["rows"]
    assert report["skipped"] == 2 and report.get("rows", report.get("pairs")) == 3, report
    if method == "sft":  # the pipeline keeps the first bad rows' messages
        assert "rows.jsonl:2: malformed JSON" in report["bad_rows"][0], report


def test_identical_pairs_are_counted_and_skipped(tmp_path, capsys):
    from tests.helpers import data_cfg, tiny_tokenizer
    from workbench.data.preference import tokenise_preferences
    from workbench.data.recipes import Source

    (tmp_path / "p.jsonl").write_text(jl(PAIR, {**PAIR, "rejected": "2"}, {**PAIR, "prompt": "2+2=", "chosen": "4"}))
    tok, contract = tiny_tokenizer()
    out = tokenise_preferences(Source(name="p", path=tmp_path / "p.jsonl"), tok, contract, data_cfg(tmp_path))
    assert len(out.pairs) == 2 and out.identical == 1
    assert all(p.chosen != p.rejected for p in out.pairs)
    err = capsys.readouterr().err
    assert "1 pair" in err and "identical" in err and "p.jsonl" in err


@pytest.mark.parametrize("case", ["data", "config"])
def test_cli_exit_status(tmp_path, case):
    """The real command line: one `error:` line, exit status 2, no traceback."""
    r = write_recipe(tmp_path, jl(chat((U, 42), (A, "2"))))
    extra, where = ([f"data.recipe={r}"], "rows.jsonl:1") if case == "data" else (["train.max_bad_steps=-3"],
                                                                                    "train.max_bad_steps=-3")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", "model=tiny", "eval=none", *extra,
                           f"output_dir={tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and where in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# Mistakes Hydra itself finds while composing: the command line still answers with one `error:`
# line naming the choice or field and status 2 (workbench/cli.py _precheck), before any import
# of torch. One subprocess each: this is what a person at the shell sees.
COMPOSE_CASES = [
    ("unknown-model", ["model=nope"], "model/nope"),
    ("unknown-method", ["method=ppo2"], "method/ppo2"),
    ("unknown-backend", ["backend=horovod"], "backend/horovod"),
    ("wrong-type", ["optim.lr=fast"], "optim.lr=fast"),
    ("misspelled-key", ["train.max_stepz=3"], "train.max_stepz"),
]


@pytest.mark.parametrize("case,overrides,where", COMPOSE_CASES, ids=[c[0] for c in COMPOSE_CASES])
def test_hydra_composition_errors_are_one_line(tmp_path, case, overrides, where):
    proc = subprocess.run([sys.executable, "-m", "workbench", *overrides, f"output_dir={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and where in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "out").exists()


# (id, overrides, the error must match): config mistakes that Hydra composes but the schema,
# the compatibility rules or preflight refuse, naming the field.
CONFIG_CASES = [
    ("unknown-key", ["+optim.lrr=1"], r"optim.lrr"),
    ("max-steps-negative", ["train.max_steps=-1"], r"train.max_steps"),
    ("micro-batch-zero", ["train.micro_batch_size=0"], r"train.micro_batch_size"),
    ("grad-accum-zero", ["train.grad_accum=0"], r"train.grad_accum"),
    ("checkpoint-every-negative", ["train.checkpoint_every=-2"], r"train.checkpoint_every"),
    ("max-bad-steps-negative", ["train.max_bad_steps=-1"], r"train.max_bad_steps"),
    ("seq-len-zero", ["data.seq_len=0"], r"data.seq_len"),
    ("lora-rank-zero", ["peft=lora", "peft.r=0"], r"peft.r"),
    ("lr-negative", ["optim.lr=-1e-4"], r"optim.lr"),
    ("procs-zero", ["hardware.procs=0"], r"hardware.procs"),
    ("dpo-loss-unknown", ["method=dpo", "method.loss_type=bogus"], r"method.loss_type"),
    ("grpo-one-generation", ["method=grpo", "method.num_generations=1"], r"method.num_generations"),
    ("resume-not-a-checkpoint", ["train.resume=/nonexistent/step-00000002"], r"train.resume=.*not a usable checkpoint"),
    ("output-dir-is-a-file", ["output_dir=__FILE__"], r"output_dir=.*is a file"),
    ("recipe-unknown", ["data.recipe=nope"], r"data.recipe='nope'"),
    ("recipe-is-a-directory", ["data.recipe=__DIR__"], r"data.recipe=.*no file"),
    ("keep-checkpoints-negative", ["train.keep_checkpoints=-1"], r"train.keep_checkpoints"),
    ("resume-damaged-checkpoint", ["train.resume=__DIR__"], r"train.resume=.*train.json is missing"),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config(tmp_path, overrides, match):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    overrides = [o.replace("__FILE__", str(a_file)).replace("__DIR__", str(tmp_path)) for o in overrides]
    own_out = any(o.startswith("output_dir=") for o in overrides)
    cfg = compose(overrides, None if own_out else tmp_path / "out", validate=False)
    with pytest.raises(UserError, match=match):
        run_job(cfg)


ENV_CASES = [
    ("precision-fp8-on-cpu", ["precision=fp8"], r"precision"),
    ("liger-on-cpu", ["kernels=liger"], r"kernels"),
    ("flash-attention-on-cpu", ["model.attn_implementation=flash_attention_2"], r"attn_implementation"),
    ("chat-template-unknown", ["data.chat_template=bogus"], r"data.chat_template='bogus'"),
    ("model-path-missing", ["model.path=/nonexistent/model"], r"/nonexistent/model"),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in ENV_CASES], ids=[c[0] for c in ENV_CASES])
def test_bad_environment(tmp_path, overrides, match):
    with pytest.raises(UserError, match=match):
        run(overrides, tmp_path)


def test_source_path_is_a_directory(tmp_path):
    (tmp_path / "rows").mkdir()
    (tmp_path / "rows" / "junk.txt").write_text("x")
    r = tmp_path / "r.yaml"
    r.write_text("name: r\nsources:\n  - path: rows\n")
    with pytest.raises(UserError, match=r"rows"):
        run([f"data.recipe={r}"], tmp_path)


def test_missing_optional_package_is_an_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(UserError, match=r"optional package 'ray' is not installed.*pip install"):
        run(["launcher=ray"], tmp_path)
