"""GRPO killed with SIGKILL mid-rollout resumes to the uninterrupted run's losses: sync and
`method.async_rollouts=true`, one and two passes per rollout (`method.num_iterations`).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_grpo_kill.py

The killed run is a `python -m workbench` child whose reward function stalls on its K-th rollout
(tests/rewards.py char_length_stalling); once it stalls and the run has gone quiet (every thread
that can move has moved: under async rollouts the training thread waits on the stalled rollout)
it gets SIGKILL. The relaunch in this process resumes from the newest checkpoint. Each kill
point leaves a checkpoint whose next step trains on a rollout the checkpoint's weights did not
make: one generated one step ahead by older weights (async), or the second pass over a rollout
generated before the last optimizer step (num_iterations=2); only sync with one pass
regenerates from the checkpoint's own weights. fp32 on one process, same layout: the resumed
steps compute what the uninterrupted ones computed in the same order, so the losses are equal
bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, TINY, train
from tests.helpers import dist_env, logged_losses
from workbench.checkpoints import checkpoint

BASE = ["method=grpo", "peft=none", 'reward.functions=["tests.rewards:char_length_stalling"]',
        "method.num_generations=4", "method.dynamic_sampling=false", "method.log_completions=0"]

# mode -> (overrides, the rollout (0-based, in the order generated) that stalls while the run is killed)
CASES = {
    # rollout 2 is step 3's (1-based): step-2's checkpoint exists, its next rollout is in progress
    "sync": (["method.num_iterations=1", "train.max_steps=4", "train.checkpoint_every=1"], 2),
    # rollout 3 (for step 4) stalls in the background while step 3 trains on rollout 2, which
    # step 2's weights made: the checkpoint after step 2 has rollout 2 pending
    "async": (["method.num_iterations=1", "method.async_rollouts=true", "train.max_steps=4",
               "train.checkpoint_every=1"], 3),
    # rollouts at steps 1, 3, 5 (1-based); step-3's checkpoint is between the two passes over rollout 1
    "sync_2iter": (["method.num_iterations=2", "train.max_steps=6", "train.checkpoint_every=3"], 2),
    # rollout k+1 is made by the weights of the step that takes rollout k; rollout 3 stalls
    "async_2iter": (["method.num_iterations=2", "method.async_rollouts=true", "train.max_steps=8",
                     "train.checkpoint_every=3"], 3),
}


# what the checkpoint resumed from held beyond the weights: (pending rollouts, the policy version
# of each: the optimizer steps behind the weights that sampled it, restored)
PENDING = {
    "sync": ("regenerated from the saved generator", [2], False),  # step-2's own weights sample step 3's
    "async": (1, [1], True),  # step 3's rollout, sampled by the weights after step 1
    "sync_2iter": (1, [2], True),  # the second pass over rollout 1, sampled after step 2
    "async_2iter": (2, [0, 2], True),  # rollout 1 (second pass) and rollout 2, already generated
}


def _quiet(paths, proc, settle=3.0, limit=240.0) -> None:
    """Wait until none of `paths` has changed for `settle` seconds."""
    def mark():
        return tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in paths)
    last, since, deadline = mark(), time.time(), time.time() + limit
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
        now = mark()
        if now != last:
            last, since = now, time.time()
        elif time.time() - since >= settle:
            return


def kill_mid_rollout(overrides: list[str], stall_at: int, out) -> None:
    mark = out / "stalled"
    env = {**dist_env(), "WORKBENCH_TEST_STALL": f"{stall_at}:{mark}"}
    proc = subprocess.Popen([sys.executable, "-m", "workbench", *TINY, *overrides, f"output_dir={out}"], cwd=ROOT,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not mark.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert mark.exists(), f"the run ended before its rollout {stall_at} stalled: {proc.stderr.read()[-3000:]}"
        _quiet([out / "metrics.jsonl", checkpoint.ckpt_root(out) / "latest"], proc)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def one_thread():
    """The killed child runs with one thread (dist_env); the uninterrupted run and the resume in
    this process do too, so every step sums in the same order and the losses compare bit for bit
    whatever thread count pytest was started with."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# the two-iteration cases in the slow tier: the default tier keeps one sync and one async kill
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) if m.endswith("_2iter") else m
                                  for m in CASES])
def test_grpo_killed_mid_rollout_resumes_to_the_same_losses(mode, tmp_path, one_thread):
    overrides, stall_at = CASES[mode]
    overrides = [*BASE, *overrides]
    full = tmp_path / "full"
    train(overrides, full)
    out = tmp_path / "killed"
    out.mkdir()
    kill_mid_rollout(overrides, stall_at, out)
    before = logged_losses(out)
    ckpt = checkpoint.latest_valid(out)
    assert ckpt is not None and len(before) < len(logged_losses(full))
    digest, position = checkpoint._sha256(ckpt / "rng.pt"), sum(checkpoint.record(ckpt)["method"]["mixture"]["taken"])
    res = train(overrides, out)
    assert res["resumed_from"] == str(ckpt)
    assert logged_losses(out) == logged_losses(full)
    cert = json.loads((out / "manifest.json").read_text())["resume"]["certificate"]
    rl = cert["rl"]
    assert cert["ok"] and rl["generator"] == "restored" and rl["same_rollouts"]
    assert (rl["generator_sha256"], rl["sampler_position"]) == (digest, position)  # the checkpoint rotates out
    assert (rl["pending_rollouts"], rl["policy_version"], rl["restored"]) == PENDING[mode]
