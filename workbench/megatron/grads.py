"""Gradients of a GPTModel trained by a torch optimizer (backend.distributed_optimizer=false):
summed over the right ranks, then their global norm.

    grads.reduce(gpt, tie_embeddings, sequence_parallel)   # after the schedule's backward
    norm = grads.norm(gpt, tie_embeddings)                 # the clip's global L2 norm

Which ranks hold copies of a gradient that must be summed:
- dense parameters: the data-parallel group (the losses are already divided by the global
  denominator, so a sum, not a mean);
- expert parameters under expert parallelism (Megatron-Core tags them `allreduce=False`): the
  *expert*-data-parallel group. Data-parallel peers at different EP ranks hold different
  experts; summing over the whole data-parallel group would add one expert's gradient to
  another's (an O(1) error, measured: 0.73-1.07 on the tiny Mixtral at ep=2);
- norms under sequence parallelism (each TP rank saw its own tokens): the TP group;
- a tied embedding split across PP stages: the first and last stage.
With backend.distributed_optimizer=true Megatron-Core's DDP and `finalize_model_grads` do this
(workbench/megatron/optimizer.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _sum(t: torch.Tensor, group) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)


def reduce(gpt, tie_embeddings: bool, sequence_parallel: bool) -> None:
    from megatron.core import parallel_state as ps

    params = [p for p in gpt.parameters() if p.requires_grad and p.grad is not None]
    dense, expert = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    for p in params:
        _sum(p.grad, dense if getattr(p, "allreduce", True) else expert)
    if sequence_parallel:
        for p in params:
            if getattr(p, "sequence_parallel", False):
                _sum(p.grad, ps.get_tensor_model_parallel_group())
    if ps.get_pipeline_model_parallel_world_size() > 1 and tie_embeddings and ps.is_rank_in_embedding_group():
        w = _gpt(gpt).shared_embedding_or_output_weight()
        if w is not None and w.requires_grad:
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())


def _gpt(model):
    return getattr(model, "module", model)


def norm(gpt, tie_embeddings: bool) -> torch.Tensor:
    """Global L2 norm: TP shards and PP stages summed once, replicated tensors counted once."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    dense = torch.zeros((), dtype=torch.float64)
    expert = torch.zeros((), dtype=torch.float64)
    pp = ps.get_pipeline_model_parallel_world_size()
    tied_copy = pp > 1 and tie_embeddings and ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    for name, p in gpt.named_parameters():
        if p.grad is None:
            continue
        if tied_copy and name.endswith("output_layer.weight"):
            continue  # the same tensor as the first stage's embedding
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        sq = p.grad.detach().double().pow(2).sum()
        if getattr(p, "allreduce", True):
            dense += sq
        else:
            expert += sq
    dist.all_reduce(dense, group=ps.get_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
    return (dense + expert).sqrt()
