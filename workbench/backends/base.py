"""The Backend contract: wrapping, forward/backward with accumulation, stepping, state.

The runner only talks to a backend through these calls, so a backend is free to shard
(FSDP2, ZeRO) or to run its own pipeline schedule (Megatron) inside forward_backward. Every
backend class names `Backend` as its base, so the optional parts below come with their
defaults: the runner calls them, it never probes for them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Protocol

import torch

from workbench.train.batch import StepBatch

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class Backend(Protocol):
    name: str
    sharded: bool = False  # each rank checkpoints its own shard (checkpoint.save/load per rank)
    external_checkpoint: bool = False  # the backend writes/reads its checkpoint files itself (DCP, DeepSpeed)
    skips_steps: bool = False  # gradients sit in param.grad before optimizer_step, so a bad step can be dropped

    def wrap(self, model: torch.nn.Module, ctx) -> None:
        """Take ownership of the model; build optimizer and scheduler."""

    def forward_backward(self, batch: StepBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over batch.micro; return loss and summed metrics."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule, zero grads; return grad_norm and lr."""

    def unwrapped(self) -> torch.nn.Module:
        """The plain module with current weights (for generation, eval and export)."""

    def generation(self) -> ContextManager[tuple[torch.nn.Module, bool]]:
        """(module for HF generate, synced): synced means every rank must keep stepping until
        all have stopped, because each step gathers sharded parameters."""

    def state_dict(self) -> dict:
        """Everything to resume: trainable weights, optimizer, scheduler, scaler."""

    def load_state_dict(self, state: dict) -> None: ...

    def gathered_model(self) -> torch.nn.Module | None:
        """The trained model as a plain module for eval and export; sharding backends gather the
        full weights onto rank 0 (a collective; None on the other ranks)."""
        return self.unwrapped().inner
