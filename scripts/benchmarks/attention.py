"""SDPA on CPU: flash-attention vs the math kernel, forward + backward, by sequence length.

    python scripts/bench.py attention [--threads 2]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, bf16, causal), with the
batch shrinking as sequences grow. `workbench/models/head.py` picks the math kernel for training
batches up to SHORT tokens on CPU, from where this crossover lies; the ratio is flash / math
time (above 1: math is faster).
"""

from __future__ import annotations

import argparse
import time

import torch


def _time(backend, batch: int, length: int, reps: int = 3) -> float:
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(batch, 9, length, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, 3, length, 64, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, 3, length, 64, dtype=torch.bfloat16, requires_grad=True)

    def once():
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    once()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t) / reps


def run(argv: list[str]) -> dict:
    from torch.nn.attention import SDPBackend

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    for batch, length in [(16, 50), (8, 128), (4, 256), (4, 512), (2, 1024), (1, 2048)]:
        flash, math = _time(SDPBackend.FLASH_ATTENTION, batch, length), _time(SDPBackend.MATH, batch, length)
        rows[f"{batch}x{length}"] = {"flash_ms": flash * 1e3, "math_ms": math * 1e3, "flash_over_math": flash / math}
    return {"threads": args.threads, "fwd_bwd": rows}
