"""A new user's first hour (issue 74, items 4-6): every bad input is one `error:` line with exit
status 2 before any weights load, `model.path` says what it was given and what to pass instead,
no setting is ignored without a word, and the configuration reference lists only keys the
command line accepts.

The seven inputs that ended in a traceback run through the real command line (one subprocess
each, on model=tiny); the rest run in-process through `cli.run_job`, as tests/unit/test_bad_input.py
does, with weight loading made to fail the test.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_first_hour_inputs.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir

from tests.conftest import CONF, ROOT, compose
from workbench.cli import run_job
from workbench.core.errors import UserError
from workbench.models import build

# A two-block llama config: what transformers reads, small enough to write by hand.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "tie_word_embeddings": True}


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the error was raised")

    monkeypatch.setattr(build, "load_model", refuse)


def config_only(root: Path, tokenizer: Path | None = None) -> Path:
    """config.json (and the tokenizer's files, when given) and no weights."""
    d = root / "config-only"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    for f in tokenizer.iterdir() if tokenizer else ():
        shutil.copyfile(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer saved to a directory, so a model directory lacks its weights and nothing else."""
    from workbench.models.load import load_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(compose(["model=tiny"]).model).save_pretrained(d)
    return d


def safetensors_bytes(n_floats: int = 64) -> bytes:
    """A safetensors file holding one fp32 tensor, written by the format's rules."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    return struct.pack("<Q", len(header)) + header + b"\0" * (4 * n_floats)


def truncated(root: Path, tokenizer: Path | None = None) -> Path:
    d = config_only(root, tokenizer).rename(root / "truncated")
    (d / "model.safetensors").write_bytes(safetensors_bytes()[:-100])  # a copy that stopped early
    return d


# -- item 4: the seven tracebacks, through the real command line ---------------------------------
SEVEN = [
    ("betas-one-number", ["optim.betas=[0.9]"], "optim.betas"),
    ("log-every-zero", ["train.log_every=0"], "train.log_every"),
    ("threads-negative", ["hardware.threads=-1"], "hardware.threads"),
    ("dropout-above-one", ["peft.dropout=1.5"], "peft.dropout"),
    ("output-dir-a-file", ["output_dir=__FILE__"], "is a file"),
    ("model-path-config-only", ["model.path=__CONFIG_ONLY__"], "has config.json but no weights"),
    ("model-path-truncated", ["model.path=__TRUNCATED__"], "is truncated"),
]


@pytest.mark.parametrize("overrides,where", [c[1:] for c in SEVEN], ids=[c[0] for c in SEVEN])
def test_the_seven_tracebacks_are_one_error_line(tmp_path, tokenizer_files, overrides, where):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    swap = {"__FILE__": str(a_file), "__CONFIG_ONLY__": str(config_only(tmp_path / "c", tokenizer_files)),
            "__TRUNCATED__": str(truncated(tmp_path / "t", tokenizer_files))}
    overrides = [re.sub("__[A-Z_]+__", lambda m: swap[m.group(0)], o) for o in overrides]
    out = [] if any(o.startswith("output_dir=") for o in overrides) else [f"output_dir={tmp_path / 'out'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", "model=tiny", "eval=none", "train.max_steps=2",
                           "train.export=false", *overrides, *out], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and where in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout and "step 1" not in proc.stdout


# -- item 4: what model.path was given, and what to pass instead ----------------------------------
def _run(overrides: list[str], tmp_path: Path):
    return run_job(compose(overrides, tmp_path / "out", validate=False))


def _run_dir(root: Path, exported: bool) -> Path:
    run = root / "runs" / "mine"
    (run / "checkpoints").mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    if exported:
        merged = run / "export" / "merged"
        merged.mkdir(parents=True)
        (merged / "config.json").write_text(json.dumps(CONFIG))
    return run


def _adapter(root: Path) -> Path:
    d = root / "my-adapter"
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "org/base"}))
    (d / "adapter_model.safetensors").write_bytes(safetensors_bytes())
    return d


def _gguf(root: Path) -> Path:
    root.mkdir(parents=True)
    f = root / "model-f16.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 60)
    return f


def _sharded(root: Path) -> Path:
    d = config_only(root).rename(root / "sharded")
    (d / "model-00001-of-00002.safetensors").write_bytes(safetensors_bytes())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    return d


MODEL_PATHS = [
    ("missing", lambda r: r / "nowhere", [r"does not exist"]),
    ("missing-close-name", lambda r: (config_only(r), r / "config-onyl")[1], [r"did you mean model.path=.*config-only"]),
    ("gguf-file", _gguf, [r"is a GGUF file", r"gguf_file=", r"model.path=DIR"]),
    ("dir-of-gguf", lambda r: _gguf(r).parent, [r"holds a GGUF file"]),
    ("run-dir-exported", lambda r: _run_dir(r, True), [r"is a workbench run directory", r"model.path=.*export/merged",
                                                       r"output_dir="]),
    ("run-dir-not-exported", lambda r: _run_dir(r, False), [r"no exported model", r"python -m workbench.export"]),
    ("adapter-dir", _adapter, [r"is a PEFT adapter", r"model.hub_id=org/base"]),
    ("config-only", config_only, [r"has config.json but no weights", r"save_pretrained"]),
    ("truncated-safetensors", truncated, [r"model.safetensors is truncated: \d[\d,]* bytes where its header describes"]),
    ("missing-shard", _sharded, [r"lists 2 shard\(s\) and 1 are missing.*00002-of-00002"]),
    ("weights-file", lambda r: truncated(r) / "config.json", [r"is a file; pass the directory that holds it"]),
]


@pytest.mark.parametrize("make,patterns", [c[1:] for c in MODEL_PATHS], ids=[c[0] for c in MODEL_PATHS])
def test_model_path_says_what_it_was_given(tmp_path, make, patterns):
    path = make(tmp_path / "here")
    for dry in ("false", "true"):  # the dry run checks what the run would load
        with pytest.raises(UserError) as err:
            _run(["model=tiny", f"model.path={path}", f"dry_run={dry}"], tmp_path)
        line = str(err.value)
        assert "\n" not in line and "no config.json there" not in line, line
        for pattern in patterns:
            assert re.search(pattern, line), (pattern, line)


def test_a_whole_model_dir_still_passes(tmp_path):
    d = config_only(tmp_path)
    (d / "model.safetensors").write_bytes(safetensors_bytes())
    from workbench.models.local_path import weights_problem, where_problem

    assert where_problem(d) is None and weights_problem(d) is None


# -- item 5: settings that had no effect ---------------------------------------------------------
IGNORED = [
    ("reward-with-sft", ["reward=arith_exact"], r"reward \(arith_exact\): method=sft samples no completions.*reward=null"),
    ("reward-with-dpo", ["method=dpo", "reward=arith_exact"], r"method=dpo samples no completions"),
    ("recipe-beside-path", ["data.recipe=arith_sft", "data.path=__ROWS__"],
     r"data.recipe=arith_sft and data.path=.*data.path replaces the recipe"),
    ("loss-on-everything", ["method.loss_on=everything"], r"method.loss_on='everything' is not one of \['assistant', 'all'\]"),
    ("warmup-negative", ["optim.warmup_steps=-5"], r"config field 'optim.warmup_steps' must be >= 0"),
    ("every-n-steps-negative", ["eval.every_n_steps=-1"], r"config field 'eval.every_n_steps' must be >= 0"),
    ("lr-1e3", ["optim.lr=1e3"], r"config field 'optim.lr' must be <= 1: a learning rate lies in \(0, 1\]"),
    ("keep-best-never-evaluated", ["data.eval_split=4", "eval.tasks=[loss]", "train.keep_best=loss/loss"],
     r"train.keep_best=loss/loss keeps nothing: no evaluation runs after a training step.*eval.at_end=true"),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in IGNORED], ids=[c[0] for c in IGNORED])
def test_a_setting_with_no_effect_is_refused(tmp_path, overrides, match):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="},
                                             {"role": "assistant", "content": "2"}]}) + "\n")
    overrides = [o.replace("__ROWS__", str(rows)) for o in overrides]
    cfg = compose(overrides, tmp_path / "out", validate=False, base=["debug=fast"])  # as the issue ran them
    with pytest.raises(UserError, match=match):
        run_job(cfg)


def test_eval_tasks_that_never_run_are_warned_by_name(tmp_path, capsys):
    facts = run_job(compose(["data.eval_split=4", "eval.tasks=[loss]", "dry_run=true"], tmp_path / "out",
                            validate=False, base=["debug=fast"]))
    said = [w for w in facts["warnings"] if w.startswith("eval.tasks=['loss'] will not run")]
    assert said and "eval.at_end=true" in said[0], facts["warnings"]
    assert "warning: eval.tasks=['loss'] will not run" in capsys.readouterr().out
    # a preset that turns evaluation off lists no task, so says nothing
    assert not [w for w in run_job(compose(["debug=overfit", "dry_run=true"], tmp_path / "o2", validate=False))
                ["warnings"] if "eval.tasks" in w]


def test_grpo_still_reads_its_reward(tmp_path):
    cfg = compose(["method=grpo", "reward=arith_exact"], tmp_path / "out")
    assert [f["name"] for f in cfg.reward.functions] == ["arith_exact"]


# -- item 6: the configuration reference lists only keys the command line accepts ----------------
def _documented() -> dict[str, list[str]]:
    """docs/reference/config.md's keys, by the group choice each table is about."""
    out: dict[str, list[str]] = {}
    where = None
    for line in (ROOT / "docs" / "reference" / "config.md").read_text().splitlines():
        if line.startswith("## "):
            where = "" if line.startswith("## Keys of the default config") else None
        heading = re.match(r"^### `((method|backend|launcher|tracker)=[\w-]+)`", line)
        if heading:
            where = heading.group(1)
        key = re.match(r"^\| `([\w.]+)` \|", line)
        if key and where is not None:
            out.setdefault(where, []).append(key.group(1))
    return out


def _composed_keys(choice: str) -> set[str]:
    from workbench.config.commandline import _config_keys

    pick = [choice.replace("tracker=", "tracker=[") + "]"] if choice.startswith("tracker=") else [choice] if choice else []
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = hydra_compose(config_name="train", overrides=pick)
    return set(_config_keys(cfg))


def test_the_reference_lists_only_keys_that_exist():
    documented = _documented()
    assert {"", "method=sft", "backend=single", "method=dpo", "backend=fsdp2"} <= set(documented), sorted(documented)
    refused = {choice: sorted(set(keys) - _composed_keys(choice)) for choice, keys in documented.items()}
    refused = {c: k for c, k in refused.items() if k}
    assert not refused, f"documented but not a config key (the command line refuses them): {refused}"


@pytest.mark.parametrize("override", ["method.recipe=arith_sft", "backend.find_unused_parameters=true"])
def test_the_two_documented_keys_are_accepted(override):
    from workbench.config.commandline import precheck

    assert precheck([override]) is None
