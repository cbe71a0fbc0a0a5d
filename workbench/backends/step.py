"""The parts of a training step that every PyTorch-autograd backend shares.

- `all_sum`: a float summed over ranks (the step's loss denominator, the logged loss).
- `accumulate`: gradient accumulation over a step's micro-batches. Each micro-batch's summed
  loss is divided by the *global* denominator (every micro-batch of every rank) and multiplied
  by the world size, because DDP, FSDP2 and ZeRO all average gradients over ranks: the result
  is the gradient of one big batch on one device. Under sequence parallelism each micro-batch
  is cut to this rank's slice of its rows first (workbench/train/sequence_parallel.py), for the
  forward and its backward.
- `clip_and_step`: unscale (fp16), clip, optimizer and scheduler step, zero grads.
- `forward_only`: one micro-batch's summed loss without gradient, in eval mode (the resume
  certificate's probe, workbench/checkpoints/replay.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from workbench.compute import precision as prec
from workbench.core import heartbeat
from workbench.peft import lora
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch
from workbench.train.distributed import reduce_scalar


def all_sum(value: float) -> float:
    """`value` summed over every rank in float64 (the value itself on one process)."""
    return reduce_scalar(value)


def accumulate(net, batch: StepBatch, loss_fn, pol, device: str, world: int, scaler=None,
               sync: Callable[[bool], contextlib.AbstractContextManager] = lambda last: contextlib.nullcontext(),
               backward: Callable[[torch.Tensor], None] | None = None) -> dict[str, float]:
    """Run forward/backward over batch.micro; `sync(last)` decides gradient communication."""
    denom = all_sum(batch.denom)
    scale = world / max(denom, 1e-12)
    total, sums = 0.0, {}
    with lora.inputs_in_autocast(net, pol.autocast_dtype):  # no fp32 round trip of adapter inputs
        for i, whole in enumerate(batch.micro):
            if batch.micro_seeds:
                torch.manual_seed(batch.micro_seeds[i])  # layout-free dropout (workbench/train/noise.py)
            with sequence_parallel.rows(whole) as micro:
                with heartbeat.phase("forward"), sync(i == len(batch.micro) - 1), prec.autocast(pol, device):
                    loss_sum, metrics = loss_fn(net, micro)
                loss = loss_sum.float() * scale
                with heartbeat.phase("backward"):
                    if backward is not None:
                        backward(loss)
                    else:
                        (scaler.scale(loss) if scaler else loss).backward()
            total += float(loss_sum.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
    return {"loss": all_sum(total) / max(denom, 1e-12), **sums}


def forward_only(net, micro: dict, loss_fn, pol, device: str) -> float:
    """loss_fn's summed loss of `micro`: no gradient, eval mode (no dropout), the run's autocast."""
    was = net.training
    net.eval()
    try:
        with torch.no_grad(), prec.autocast(pol, device):
            loss_sum, _ = loss_fn(net, micro)
    finally:
        net.train(was)
    return float(loss_sum.detach().float())


def clip_and_step(params, optimizer, scheduler, scaler, max_grad_norm: float) -> dict[str, float]:
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for p in params if p.grad is not None]
    if max_grad_norm > 0:
        gn = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        gn = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in params]))
    gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # a DTensor under FSDP2
    lr = scheduler.get_last_lr()[0]
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(gn), "lr": lr}
