"""GRPO's `reward=model` scoring: one row per prompt (its completions as branches) vs a row each.

    python scripts/bench.py grpo_reward [--prompts 16] [--generations 8] [--rounds 3]

A sequence classifier built from SmolLM2-135M (a scalar head with random weights, what a
method=rm export is) scores `--generations` completions of each of `--prompts` embedded
arithmetic prompts with `workbench.rollout.reward_model.ModelReward`, in both layouts,
alternating, `reward.batch_size` (16) completions a forward, fp32. The completions are the
chosen and rejected texts of the embedded held-out preference pairs (bare numbers and rambling
sentences of up to ~25 tokens, what GRPO samples early), drawn with a fixed seed. Reported:
median seconds of each layout, their ratio, the tokens each layout reads, and how far the two
layouts' scores differ (rounding only).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def run(argv: list[str]) -> dict:
    import torch

    from benchmarks._common import reward_classifier
    from workbench.data.pair_tree import common_prefix
    from workbench.evals.hooks import eval_rows
    from workbench.rollout.reward_model import ModelReward

    ap = argparse.ArgumentParser(prog="bench.py grpo_reward")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args(argv)
    clf, tok, contract = reward_classifier()  # SmolLM2 with a random scalar head

    rows = eval_rows("arith_pref", a.prompts)
    pool = [r[k] for r in eval_rows("arith_pref", 100) for k in ("chosen", "rejected")]
    rng = random.Random(0)
    prompts = [r["prompt"] for r in rows for _ in range(a.generations)]
    completions = [rng.choice(pool) for _ in prompts]

    reward = ModelReward(".", batch_size=a.batch_size)
    reward.model, reward.tokenizer, reward.contract = clf, tok, contract
    seqs = reward.encode(prompts, completions)
    times: dict[str, list[float]] = {"row_per_completion": [], "row_per_prompt": []}
    scores = {}
    for _ in range(a.rounds):
        for name, share in (("row_per_completion", False), ("row_per_prompt", True)):
            reward.share_prompt = share
            t = time.perf_counter()
            scores[name] = torch.tensor(reward(prompts=prompts, completions=completions))
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    groups = [seqs[i:i + a.generations] for i in range(0, len(seqs), a.generations)]  # a prompt's completions
    tree_tokens = sum(sum(map(len, g)) - common_prefix(g) * (len(g) - 1) for g in groups)
    one, each = scores["row_per_prompt"], scores["row_per_completion"]
    return {"prompts": a.prompts, "generations": a.generations, "batch_size": a.batch_size, "precision": "fp32",
            "seconds": times, "median_seconds": med, "speedup": med["row_per_completion"] / med["row_per_prompt"],
            "tokens_read": {"row_per_completion": sum(len(s) for s in seqs), "row_per_prompt": tree_tokens},
            "score_max_abs_diff": float((one - each).abs().max()), "score_scale": float(each.abs().max())}
