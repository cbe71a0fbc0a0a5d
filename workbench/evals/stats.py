"""Binomial 95% intervals for the accuracies a run reports, so a difference can be read against
the noise of a finite test split.

    wilson(90, 100)            # (0.8256, 0.9448): 90 of 100 right
    intervals(results)         # {"eval/arith_add2/accuracy_ci95": [lo, hi], ...} beside each accuracy

The Wilson score interval, not the normal approximation: it stays inside [0, 1] and keeps its
coverage at 0% and 100%, which is where before-training and after-training accuracies sit.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the two-sided 95% quantile of the standard normal


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for `successes` out of `n` trials (a fraction of them is allowed:
    a ranking accuracy that counts ties as half)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def intervals(metrics: dict) -> dict:
    """`<prefix>/<name>_ci95: [lo, hi]` (4 decimals) for every `<prefix>/<name>` ending in
    "accuracy" whose `<prefix>/n` says how many questions it was measured on."""
    out = {}
    for key, value in metrics.items():
        prefix, _, name = key.rpartition("/")
        n = metrics.get(f"{prefix}/n")
        if name.endswith("accuracy") and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and isinstance(n, int) and not isinstance(n, bool) and n > 0 and 0 <= value <= 1:
            out[f"{key}_ci95"] = [round(x, 4) for x in wilson(value * n, n)]
    return out
