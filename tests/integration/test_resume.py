"""Resuming, in one process: the replay certificate on every resume (and a checkpoint with one weight
changed failing it), refusals before any weights load, the resume plan of dry_run=true, and
GRPO resumed between the passes over one rollout.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_resume.py

Moves between backends and world sizes: tests/distributed/test_resume_moves.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY, compose, train
from workbench.checkpoints import checkpoint
from workbench.core.errors import UserError

FULL = ["peft=none", "train.micro_batch_size=2", "train.grad_accum=2", "train.checkpoint_every=2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A 2-step full fine-tune with its step-2 checkpoint."""
    out = tmp_path_factory.mktemp("written")
    train([*FULL, "train.max_steps=2"], out)
    return out


def _flip_one_weight(step):
    """Negate one element of the final norm's weight (1.0 -> -1.0) in the checkpoint's tensor file
    and record the file's new checksum, so only the certificate can tell."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    f = next((step / checkpoint.CANONICAL).glob("*.safetensors"))
    with safe_open(str(f), "pt") as h:
        meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
    tensors["model/model.norm.weight"][0] *= -1
    save_file(tensors, str(f), metadata=meta)
    (step / checkpoint.FILES).write_text(json.dumps({"files": checkpoint._inventory(step)}))
    assert checkpoint.verify(step) is None


def test_every_resume_is_certified_and_a_changed_weight_fails(written, tmp_path):
    good = tmp_path / "good"
    shutil.copytree(written, good)
    res = train([*FULL, "train.max_steps=3"], good)
    cert = json.loads((good / "manifest.json").read_text())["resume"]["certificate"]
    assert cert == res["resume"]["certificate"] and cert["ok"] and cert["from"] == cert["to"] == "single"
    assert cert["probe_loss_resumed"] == cert["probe_loss"] and cert["tolerance"] == 1e-5
    assert "resume certificate: ok" in (good / "report.md").read_text()

    bad = tmp_path / "bad"
    shutil.copytree(written, bad)
    _flip_one_weight(checkpoint.ckpt_root(bad) / "step-00000002")
    with pytest.raises(UserError, match=r"resume certificate failed for .*step-00000002: .*relative difference "
                                        r".* > 1.0e-05\): these are not the weights it saved"):
        train([*FULL, "train.max_steps=3"], bad)
    failed = json.loads((bad / "manifest.json").read_text())["resume"]["certificate"]
    # on the tiny random model (loss about log V, small logits) the flip moves the probe by 3.8e-5
    assert not failed["ok"] and failed["rel_diff"] > 2 * failed["tolerance"]
    warned = train([*FULL, "train.max_steps=3", "train.resume_check=warn"], bad)
    assert not warned["resume"]["certificate"]["ok"] and len(warned["losses"]) == 1


def test_a_lora_checkpoint_into_full_fine_tuning_is_refused_before_weights_load(tmp_path, monkeypatch):
    train(["peft=lora", "train.max_steps=1"], tmp_path)
    from workbench.run import runner

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(runner, "build_model", no_weights)
    with pytest.raises(UserError, match=r"step-00000001 holds a LoRA adapter \(peft=lora\); this run is peft=none"):
        train(["peft=none", "train.max_steps=2"], tmp_path)


def test_dry_run_plans_the_move(written, tmp_path):
    from workbench.run import preflight

    facts = preflight.check(compose([*FULL, "dry_run=true", "backend=fsdp2", "hardware.procs=2"], written))
    assert facts["resume"] == ("resume: step-00000002 (step 2, 8 samples, written by single) -> fsdp2x2: micro-batch "
                               "2 x grad_accum 1 x 2 data-parallel = global batch 4 (kept); fits")
    # three ranks cannot split 4 rows: one error line, exit 2, naming the layouts that can
    argv = [*TINY, *FULL, "dry_run=true", "hardware.procs=3", f"output_dir={written}"]
    proc = subprocess.run([sys.executable, "-m", "workbench", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert errors[0] == ("error: resuming step-00000002 (global batch 4 = 2 x 2 x 1 dp, written by single) at 3 "
                         "data-parallel rank(s) with train.micro_batch_size=2 cannot keep the global batch; use "
                         "hardware.procs=2 (train.grad_accum=1) or train.keep_global_batch=false")


GRPO = ["method=grpo", "peft=none", 'reward.functions=["tests.rewards:char_length"]',
        "method.num_generations=4", "method.dynamic_sampling=false", "method.num_iterations=2",
        "method.log_completions=4", "train.checkpoint_every=1"]


def test_grpo_resumed_between_passes_samples_the_same_prompts_again(tmp_path):
    """A checkpoint after the first of two passes over a rollout keeps that rollout; one without
    it (read at another layout, or written before checkpoints kept rollouts) makes the rollout
    again from the same prompts (the data position after it is the checkpoint's). SIGKILL with
    the rollout kept: tests/integration/test_grpo_kill.py."""
    train([*GRPO, "train.max_steps=1"], tmp_path)
    step = checkpoint.ckpt_root(tmp_path) / "step-00000001"
    state = checkpoint.record(step)["method"]
    assert state["rollout"]["uses"] == 1 and state["rollout"]["index"] == 0 and state["pending"] == [0]
    (step / "rollouts.pt").unlink()
    (step / checkpoint.FILES).write_text(json.dumps({"files": checkpoint._inventory(step)}))
    res = train([*GRPO, "train.max_steps=3"], tmp_path)  # step 2: the same rollout again; step 3: a new one
    rl = res["resume"]["certificate"]["rl"]
    assert (rl["pending_rollouts"], rl["policy_version"], rl["restored"], rl["same_rollouts"]) == (1, [0], False, False)
    rows = [json.loads(x) for x in (tmp_path / "samples" / "grpo.jsonl").read_text().splitlines()]
    first, again, third = rows[:4], rows[4:8], rows[8:12]
    assert [r["prompt"] for r in again] == [r["prompt"] for r in first]
    assert {r["prompt"] for r in third} != {r["prompt"] for r in first}  # then the next prompts
