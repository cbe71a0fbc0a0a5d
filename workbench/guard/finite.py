"""Whether the gradients a step would apply are finite, on this rank's shards: what the fault
guard (workbench/guard/faults.py Guard.judge) asks a backend that can skip a step
(workbench/backends/base.py gradients_finite)."""

from __future__ import annotations

import torch


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
