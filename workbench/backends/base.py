"""The Backend contract: wrapping, forward/backward with accumulation, stepping, state.

The runner only talks to a backend through these calls, so a backend is free to shard
(FSDP2, ZeRO) or to run its own pipeline schedule (Megatron) inside forward_backward. Every
backend class names `Backend` as its base, so the optional parts below come with their
defaults: the runner calls them, it never probes for them.

State goes through one format every layout reads (workbench/checkpoints/canonical.py): a backend
gives its part of the canonical tensors (`canonical_state`) and fills itself from a reader
(`load_canonical`), in its own shapes and shards; the schedule travels as JSON.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from pathlib import Path
from typing import Protocol

import torch

from workbench.checkpoints import canonical
from workbench.guard.finite import grads_finite
from workbench.train.batch import StepBatch

LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class Backend(Protocol):
    name: str
    skips_steps: bool = False  # gradients sit in param.grad before optimizer_step, so a bad step can be dropped
    optimizer: torch.optim.Optimizer | None  # built by wrap (Megatron's own optimizer aside)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    def wrap(self, model: torch.nn.Module, ctx) -> None:
        """Take ownership of the model; build optimizer and scheduler."""

    def forward_backward(self, batch: StepBatch, loss_fn: LossFn) -> dict[str, float]:
        """Accumulate gradients over batch.micro; return loss and summed metrics."""

    def optimizer_step(self) -> dict[str, float]:
        """Clip, step, schedule, zero grads; return grad_norm and lr."""

    def gradients_finite(self) -> bool:
        """Whether every gradient this rank's optimizer would apply is finite (a backend that
        skips_steps; the fault guard asks before the update)."""
        return grads_finite(self.optimizer)

    def discard_gradients(self) -> dict[str, float]:
        """Drop this step's gradients, the weights untouched (a refused update): grad_norm NaN
        and the learning rate the step would have used."""
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": float("nan"), "lr": self.scheduler.get_last_lr()[0]}

    def held(self) -> dict[str, list]:
        """What this rank holds beside its modules' parameters and gradients, for dry_run=trace's
        memory tracker (workbench/plan/trace.py): "optimizers", the torch optimizers with its
        optimizer state; "grads", gradient buffers the parameters' .grad do not show."""
        return {"optimizers": [self.optimizer] if self.optimizer is not None else [], "grads": []}

    def unwrapped(self) -> torch.nn.Module:
        """The plain module with current weights (for generation, eval and export)."""

    def generation(self) -> ContextManager[tuple[torch.nn.Module, bool]]:
        """(module for HF generate, synced): synced means every rank must keep stepping until
        all have stopped, because each step gathers sharded parameters."""

    def forward_only(self, micro: dict, loss_fn: LossFn) -> float:
        """loss_fn's summed loss over its `target_tokens`, no gradient, the same micro-batch on
        every rank (collective under sharding): the replay certificate's probe."""

    def canonical_state(self) -> dict:
        """This rank's part of the canonical tensors (collective): trainable weights and their
        optimizer state under canonical names (workbench/checkpoints/canonical.py)."""

    def save_canonical(self, path: Path):
        """Write the canonical tensors into `path` (collective); a future when the write goes on
        in the background (checkpoint.flush commits it), else None."""
        return canonical.write(path, self.canonical_state())

    def load_canonical(self, read: canonical.Reader) -> None:
        """Fill weights and optimizer state: build what this rank needs in its own shapes, `read` it."""

    def schedule_state(self) -> dict:
        """The LR schedule (and loss scaler) as JSON (canonical.schedule_state)."""

    def load_schedule(self, state: dict) -> None: ...

    def load_legacy(self, path: Path, rank: int) -> None:
        """A checkpoint from before the canonical format, at the layout that wrote it."""
        raise NotImplementedError

    def gathered_model(self) -> torch.nn.Module | None:
        """The trained model as a plain module for eval and export; sharding backends gather the
        full weights onto rank 0 (a collective; None on the other ranks)."""
        return self.unwrapped().inner
