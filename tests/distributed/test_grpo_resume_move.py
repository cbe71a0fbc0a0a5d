"""GRPO's state beyond the weights across a move: a one-process run's checkpoint resumed by a
2-rank FSDP2 run keeps the certificate's `rl` part (sampler position, generator digest, policy
version of the pending rollout) and says what it could not carry.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m distributed tests/distributed/test_grpo_resume_move.py

Two writers on one process, global batch 2 prompts x 4 completions (grad_accum 2), each resumed
under FSDP2 at 2 ranks (grad_accum 1, one prompt per rank):

- one pass per rollout, resumed after step 2: nothing is pending (the next rollout is sampled by
  the checkpoint's weights, with noise keyed by (train.seed, step, prompt index): the same
  completions at any world size), so steps 3 and 4 equal the one-process run's within
  LOSS_RTOL (tests/tolerances.py: only the order of the reductions over ranks differs).
- two passes per rollout, resumed after step 3, between the passes over the rollout sampled by
  step 2's weights: that rollout is saved per rank (rank 0 held all 8 completions), which another
  layout cannot split into its ranks' shares, so it is sampled again from the same prompts by the
  checkpoint's weights; the certificate says so (`restored: false`, `same_rollouts: false`) and
  step 4's loss is that of another rollout.

The RNG state is restored only at the layout that wrote it; here each rank is re-seeded from
(train.seed, step, rank), and `generator` says so.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import train
from tests.helpers import worker_job
from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL
from workbench.checkpoints import checkpoint

pytestmark = pytest.mark.distributed
GRPO = ["method=grpo", "peft=none", 'reward.functions=["tests.rewards:char_length"]', "method.num_generations=4",
        "method.dynamic_sampling=false", "method.log_completions=0", "train.micro_batch_size=4",
        "++hardware.timeout_minutes=4", "train.max_steps=4", "train.checkpoint_every=1", "train.keep_checkpoints=4"]
ONE, TWO = ["method.num_iterations=1"], ["method.num_iterations=2"]


def test_grpo_saved_at_one_process_resumed_at_two_keeps_the_rl_certificate(tmp_path):
    one = {name: train([*GRPO, *ov, "train.grad_accum=2"], tmp_path / name)["losses"]
           for name, ov in (("one", ONE), ("two", TWO))}
    at = {"one": 2, "two": 3}
    step = {n: checkpoint.ckpt_root(tmp_path / n) / f"step-{at[n]:08d}" for n in at}
    res = worker_job([{"name": f"{n}_fsdp2", "overrides": [*GRPO, *ov, "backend=fsdp2", f"train.resume={step[n]}"]}
                      for n, ov in (("one", ONE), ("two", TWO))], tmp_path / "moved")
    rl = {}
    for n in at:
        cert = json.loads((tmp_path / "moved" / f"{n}_fsdp2" / "manifest.json").read_text())["resume"]["certificate"]
        assert (cert["from"], cert["to"], cert["ok"]) == ("single", "fsdp2x2", True), cert
        rl[n] = cert["rl"]
        assert rl[n]["generator"] == f"re-seeded from (train.seed, step {at[n]}, rank 0)"
        assert rl[n]["generator_sha256"] == checkpoint._sha256(step[n] / "rng.pt")
        assert rl[n]["sampler_position"] == sum(checkpoint.record(step[n])["method"]["mixture"]["taken"])
    assert rl["one"]["pending_rollouts"] == "regenerated from the saved generator" and rl["one"]["same_rollouts"]
    assert res["one_fsdp2"]["losses"] == pytest.approx(one["one"][2:], rel=LOSS_RTOL, abs=NEAR_ZERO_ATOL)
    assert (rl["two"]["pending_rollouts"], rl["two"]["policy_version"], rl["two"]["restored"],
            rl["two"]["same_rollouts"]) == (1, [2], False, False)
    # sampled again by step 3's weights: the second pass's ratio to them is 1, the uninterrupted one's is not
    assert res["two_fsdp2"]["losses"] != pytest.approx(one["two"][3:], rel=1e-2)
