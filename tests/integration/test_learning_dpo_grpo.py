"""Learning outcomes of DPO and GRPO on SmolLM2-135M (slow: minutes of CPU each).

    OMP_NUM_THREADS=2 .venv/bin/python -m pytest -q -m slow tests/integration/test_learning_dpo_grpo.py -s

- DPO (LoRA, the embedded arith pairs, rpo_alpha=1): held-out preference accuracy (chosen
  log-prob above rejected, arith_pref_eval.jsonl) goes from its starting value to >= 90%.
- GRPO (LoRA, method=grpo's batch defaults, reward=arith_exact, from a 20-step SFT warm start):
  held-out exact-match accuracy on 2-digit addition rises by >= 15 points over that starting
  policy; and `method=grpo` as shipped (reward=arith_digits, unscaled
  advantages) from SmolLM2 itself (0%) on seed 5, the seed on which the earlier default
  collapsed, by >= 25 points.
"""

from __future__ import annotations

import time

import pytest

from tests.conftest import train

BASE = ["train.export=false", "train.resume=never", "train.log_every=5", "eval.at_start=true", "eval.at_end=true",
        "eval.num_samples=200"]


@pytest.mark.slow
def test_dpo_moves_preference_accuracy(tmp_path):
    """DPO with the chosen completion's NLL added (method.rpo_alpha=1, RPO). Plain sigmoid DPO
    barely moves this metric on SmolLM2-135M (0.715 -> 0.720 on 200 pairs, 80 steps, lr 5e-4): it widens
    the reference-relative gap, while "chosen log-prob above rejected" needs the right number's
    own likelihood to rise."""
    t = time.perf_counter()
    res = train(["method=dpo", "method.rpo_alpha=1.0", "train.max_steps=60", "train.micro_batch_size=8",
                 "eval.tasks=[arith_pref]", *BASE], tmp_path, base=[])
    before = res["eval_start"]["eval/arith_pref/accuracy"]
    after = res["eval_end"]["eval/arith_pref/accuracy"]
    print(f"\nDPO held-out preference accuracy {before:.3f} -> {after:.3f} in {time.perf_counter() - t:.0f}s")
    assert after >= 0.90 and after > before


@pytest.mark.slow
def test_grpo_raises_exact_match(tmp_path):
    """GRPO with method=grpo's defaults (8 generations, 4 prompts per step, dynamic sampling,
    unscaled advantages, 100 steps) and reward=arith_exact, from a short SFT warm start.
    SmolLM2-135M-Instruct itself scores 0% here and its sampled answers are almost never a bare
    correct number ("19 + 24 = 32", "The answer is 154."), so arith_exact rewards are all zero;
    20 LoRA SFT steps, merged into the weights, give a starting policy near 35-40%. Both in fp32:
    on CPUs without native bf16 that is 5x faster.

    One seed with a margin: across seeds 0, 1, 2 (scripts/grpo_seeds.py, README; bf16-mixed) the
    gains were +44, +43 and +40 points; this seed must gain 15, the issue's bar for every seed."""
    seed = ["train.seed=0", "data.shuffle_seed=0"]  # seed 0 of the table
    sft = train(["train.max_steps=20", "precision=fp32", "train.resume=never", "eval=none", "train.export=true", *seed],
                tmp_path / "sft", base=[])
    t = time.perf_counter()
    res = train(["method=grpo", "reward=arith_exact", f"model.path={sft['export']['merged']}", "precision=fp32",
                 "eval.tasks=[arith_add2]", *seed, *BASE], tmp_path / "grpo", base=[])
    wall = time.perf_counter() - t
    before = res["eval_start"]["eval/arith_add2/accuracy"]
    after = res["eval_end"]["eval/arith_add2/accuracy"]
    print(f"\nGRPO held-out exact match {before:.3f} -> {after:.3f} in {wall:.0f}s")
    assert after - before >= 0.15


@pytest.mark.slow
def test_grpo_default_learns_from_the_base_model(tmp_path):
    """`python -m workbench method=grpo` as shipped (reward=arith_digits: exact match plus 0.2 x the
    share of right digits of a number as long as the answer; scale_rewards=none), from SmolLM2
    itself, which scores 0%, at the machine's own precision (precision=auto). Seed 5 is the one
    on which the earlier default (arith_format, std-scaled advantages) collapsed to one-digit
    answers and stayed at 0% (bf16 and fp32); it must gain 25 points. The README table has
    seeds 0-5 (scripts/grpo_seeds.py)."""
    res = train(["method=grpo", "eval.tasks=[arith_add2]", "train.seed=5", "data.shuffle_seed=5", *BASE], tmp_path,
                base=[])
    before = res["eval_start"]["eval/arith_add2/accuracy"]
    after = res["eval_end"]["eval/arith_add2/accuracy"]
    print(f"\nGRPO from the base model, seed 5: held-out exact match {before:.3f} -> {after:.3f}")
    assert not res.get("stalled"), res.get("stalled")
    assert after - before >= 0.25
