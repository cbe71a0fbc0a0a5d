"""The Method contract: how training batches are made and what the loss is.

A method never calls the model outside `loss()`, and `loss()` is only called by the backend
(inside `Backend.forward_backward`), which is what lets any method run on any backend. Every
method class names `Method` as its base, so the optional hooks below come with their defaults:
the runner calls them, it never probes for them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workbench.train.batch import StepBatch


class Method(Protocol):
    name: str

    def prepare(self, ctx) -> None:
        """Read and tokenise data; everything that needs no weights."""

    def next_batch(self, state, backend) -> StepBatch:
        """The next step's batch (GRPO generates here, with the backend's current weights)."""

    def loss(self, model: torch.nn.Module, micro: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed (not averaged) loss of one micro-batch, and summed metrics."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def attach(self, backend) -> None:
        """Once the backend holds the model, before the first step (DPO sets up its reference)."""
        return None

    def data_report(self) -> dict:
        """Per data source: rows, skipped, truncated, fingerprint (for the manifest)."""
        return {}

    def stall_watch(self):
        """A `StallWatch` (workbench/train/signal.py) for a method whose steps can carry no
        gradient (GRPO), or None."""
        return None

    def rollouts_state(self) -> dict:
        """This rank's work a checkpoint cannot make again from its weights and RNG: a generating
        method's rollouts already sampled for the next steps (GRPO: one step ahead, or reused by a
        further pass), as tensors, lists and numbers (saved per rank, read with weights_only=True).
        Asked only when a checkpoint is written."""
        return {}

    def load_rollouts(self, saved: dict | None) -> None:
        """What `rollouts_state` saved, on a resume at the layout that wrote it; None elsewhere."""
        return None

    def resume_facts(self, state: dict) -> dict:
        """A generating method's part of the resume certificate (`rl`), from `state`: the step
        resumed, the digest of the RNG state the resume set and whether it was restored. {}: none."""
        return {}
