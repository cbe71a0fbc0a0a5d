"""One optimizer step on a backend: forward and backward over the step's micro-batches, then the
update, with a check between them that may refuse the update.

    metrics = step(backend, batch, loss_fn, refuse)   # refuse(metrics) -> None, or why not

Only the Backend protocol's calls are used (workbench/backends/base.py): forward_backward,
optimizer_step, and discard_gradients for a refused update. What is refused and what a refusal
means for the run (a skipped step, or a stop with the last good checkpoint) is the fault guard's
(workbench/train/faults.py Guard.step, which wraps this); the loop (workbench/run/loop.py) calls
the guard once per step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.core import heartbeat


def step(backend, batch, loss_fn, refuse: Callable[[dict], str | None]) -> dict:
    """The step's metrics (loss, the method's metrics, grad_norm, lr); `bad_step`: 1 where
    `refuse` gave a reason and the gradients were dropped, the weights untouched."""
    with heartbeat.phase("forward"):  # backends mark forward and backward inside (backends/step.py)
        metrics = backend.forward_backward(batch, loss_fn)
    if refuse(metrics) is not None:
        metrics.update(backend.discard_gradients(), bad_step=1)
        return metrics
    with heartbeat.phase("optimizer"):
        metrics.update(backend.optimizer_step())
    return metrics


def grads_finite(optimizer) -> bool:
    """Whether every gradient the optimizer would apply is finite (this rank's shards)."""
    grads = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                g = p.grad
                grads.append(g.to_local() if hasattr(g, "to_local") else g)  # DTensor shard under FSDP2
    if not grads:
        return True
    norms = torch._foreach_norm(grads)
    return bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
