"""Held-out pair scoring of a reward model: one row per pair (the prompt read once) vs two rows.

    python scripts/bench.py pair_eval [--pairs 100] [--rounds 2] [--precision fp32]

SmolLM2-135M with a scalar head (what method=rm trains) scores the embedded held-out preference
pairs with `workbench.methods.rm.pair_rewards` in both layouts, alternating, in batches of
`eval.batch_size` (50, the arithmetic evaluation's). Reported: median seconds of each layout,
their ratio, and how far the two layouts' rewards and decisions differ (rounding only).
"""

from __future__ import annotations

import argparse
import statistics
import time


def run(argv: list[str]) -> dict:

    from benchmarks._common import reward_model
    from workbench.compute import precision
    from workbench.data.preference import pairs_from_rows
    from workbench.evals.hooks import eval_rows
    from workbench.methods.rm import pair_rewards

    ap = argparse.ArgumentParser(prog="bench.py pair_eval")
    ap.add_argument("--pairs", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed"])
    a = ap.parse_args(argv)
    model, tok, contract = reward_model()
    pairs = pairs_from_rows(eval_rows("arith_pref", a.pairs), tok, contract)
    autocast = precision.autocast(precision.policy(a.precision), "cpu")  # fp32: no autocast
    times: dict[str, list[float]] = {"one_row_per_pair": [], "two_rows_per_pair": []}
    rewards = {}
    for _ in range(a.rounds):
        for name, share in (("two_rows_per_pair", False), ("one_row_per_pair", True)):
            t = time.perf_counter()
            rewards[name] = pair_rewards(model, pairs, tok.pad_token_id, a.batch_size, autocast, share_prompt=share)
            times[name].append(time.perf_counter() - t)
    one, two = rewards["one_row_per_pair"], rewards["two_rows_per_pair"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"pairs": len(pairs), "precision": a.precision, "seconds": times, "median_seconds": med,
            "speedup": med["two_rows_per_pair"] / med["one_row_per_pair"],
            "reward_max_abs_diff": float((one - two).abs().max()), "reward_scale": float(two.abs().max()),
            "decisions_agree": int(((one[0] > one[1]) == (two[0] > two[1])).sum())}
