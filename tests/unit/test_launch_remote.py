"""What remote launchers ship: the composed config (secrets redacted, training values intact)
and the launch manifest; and the far-side command reproduces the run from its run dir alone.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_launch_remote.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose
from workbench.launch import remote


def test_shipped_config_redacts_secrets_but_keeps_training_values(tmp_path):
    cfg = compose([], tmp_path)
    shipped = remote.composed_config(cfg)
    assert shipped["launcher"] == {"name": "local"}  # the far side trains, it does not launch again
    assert shipped["model"]["tokenizer"] == cfg.model.tokenizer
    assert shipped["eval"]["max_new_tokens"] == cfg.eval.max_new_tokens
    assert shipped["model"]["arch"]["experts_per_token"] == cfg.model.arch.experts_per_token
    extra = remote.composed_config(OmegaConf.create({"tracking": {"wandb_api_key": "sk-1", "hf_token": "hf_x",
                                                                  "project": "p"}}))
    assert extra["tracking"] == {"wandb_api_key": "<redacted>", "hf_token": "<redacted>", "project": "p"}


def test_job_spec_has_manifest_and_no_secret_values(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf-very-secret")
    spec = remote.job_spec(compose([], tmp_path / "r1"), "modal")
    assert spec["name"] == "r1"
    assert {"versions", "git", "submitted_from", "launcher", "overrides"} <= set(spec["manifest"])
    assert "hf-very-secret" not in json.dumps(spec)
    assert remote.env_from_host(["HF_TOKEN", "NOT_SET_ANYWHERE"]) == {"HF_TOKEN": "hf-very-secret"}


def test_far_side_command_reproduces_the_run_from_its_run_dir(tmp_path):
    cfg = compose(["train.max_steps=2", "train.micro_batch_size=2", "data.seq_len=64"], tmp_path / "local")
    run_dir = tmp_path / "far" / "run"
    remote.materialize(remote.job_spec(cfg, "test"), run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(remote.command(str(run_dir), sys.executable), cwd=ROOT, env=env, capture_output=True,
                          stdin=subprocess.DEVNULL,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(json.loads((run_dir / "results.json").read_text())["losses"]) == 2
    ran = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())  # what the far side composed
    sent = yaml.safe_load((run_dir / "launch" / "job_config.yaml").read_text())
    assert ran["output_dir"] == str(run_dir)
    for key in ("model", "optim", "train", "data", "peft", "precision"):
        assert ran[key] == {**sent[key]}, key
