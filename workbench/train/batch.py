"""`StepBatch`: one optimizer step's data, the one type both methods and backends handle.

Methods make it (`Method.next_batch`), backends consume it (`Backend.forward_backward`); it
lives below both so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepBatch:
    """One optimizer step's worth of data for this rank.

    `micro` are the micro-batches (gradient accumulation happens over them). `denom` is what
    this rank's summed loss is divided by (target tokens for SFT, pairs for DPO); backends
    add it up over ranks so the loss is normalised by the *global* batch, never per
    micro-batch (the gradient-accumulation normalisation bug).
    """

    micro: list[dict[str, Any]]
    denom: float
    tokens: int  # input tokens, for throughput
    info: dict[str, float] = field(default_factory=dict)
    # forward passes without gradient the step ran besides its micro-batches (the rollouts of GRPO
    # and on-policy distillation, GRPO's old log-probs), for the FLOP count (workbench/compute/flops.py)
    forward_passes: list[Forward] = field(default_factory=list)
    # the share of what the step trains on (all ranks) that carries gradient: 1.0 for most methods;
    # GRPO: groups with reward spread (workbench/train/signal.py watches it)
    signal: float = 1.0
    # when the model has dropout: a seed per micro-batch, keyed by its rows' global sample index
    # (workbench/train/noise.py), set by the runner; backends seed the generator with it before
    # each micro-batch's forward, so the masks do not depend on the world size
    micro_seeds: list[int] | None = None


@dataclass(frozen=True)
class Forward:
    """One forward pass of the policy without gradient: `rows` x `seq` new positions, each
    attending to `ctx` positions (the last `seq` of them new, the rest from a KV cache), the
    vocabulary head on `heads` positions. A decode step of generation is (rows, 1, ctx, rows)."""

    rows: int
    seq: int
    ctx: int
    heads: int
