"""Vocabulary-parallel softmax terms on this TP rank's columns of the logits, never the full vocabulary.

    shard = VocabShard(local_logits, vocab)            # [N, V_padded / tp] of this TP rank
    shard.target_logprobs(targets, temperature)        # log p(target), (N,)
    shard.entropy(temperature)                         # (N,)
    shard.generalised_jsd(teacher_logits, beta, T)     # methods/distill.py's divergence, (N,)

What crosses ranks per softmax is one MAX and one SUM all-reduce of N numbers (several softmaxes
share them), and one SUM of N numbers per term: no [N, V] all-gather. Two things the plain
formulas hide:
- The bridge pads the vocabulary to a multiple of tp with zero rows, whose logits are exactly 0:
  they are masked to -inf here (Megatron-Core's vocab_parallel_cross_entropy counts them in its
  partition function, an error of ~1e-4 on the tiny model's logits).
- A log-sum-exp that is replicated over TP but feeds per-column terms that are summed again
  needs `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward): without
  it each rank's gradient misses the other ranks' share of d/d lse (an O(1) error in the
  divergence gradients). The target log-prob uses the lse once, after the reduction, so its
  gradient is right without the copy.
A teacher's logits may be full-vocabulary on every rank (a frozen HF model): each rank reads
its own columns, without communication.
"""

from __future__ import annotations

import math

import torch


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()


class VocabShard:
    """This TP rank's columns of the logits at the selected positions."""

    def __init__(self, local: torch.Tensor, vocab: int):
        self.local, self.vocab = local, vocab
        group, rank = _tp()
        self.group = group
        self.per = local.shape[-1]
        self.start = rank * self.per
        self.real = max(0, min(self.per, vocab - self.start))  # columns of the real vocabulary

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.local.shape[:-1], self.vocab))

    def _scaled(self, z: torch.Tensor, temperature: float) -> torch.Tensor:
        z = z.float() / temperature
        if self.real < self.per:  # padded columns: probability 0
            z = torch.cat([z[..., :self.real], torch.full_like(z[..., self.real:], float("-inf"))], dim=-1)
        return z

    def columns(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's columns of full-vocabulary logits (a teacher's), padded like the student's."""
        part = full[..., self.start:self.start + self.real]
        pad = self.per - part.shape[-1]
        return torch.cat([part, part.new_zeros(*part.shape[:-1], pad)], dim=-1) if pad else part

    def _logsumexp(self, zs: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_sum

        m = torch.stack([z.detach().amax(-1) for z in zs])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.group)  # a shift: no gradient flows through it
        s = reduce_sum(torch.stack([(z - mi.unsqueeze(-1)).exp().sum(-1) for z, mi in zip(zs, m)]), group=self.group)
        return list(m + s.log())

    def target_logprobs(self, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_sum

        z = self._scaled(self.local, temperature)
        (lse,) = self._logsumexp([z])
        local = targets - self.start
        inside = (local >= 0) & (local < self.per)
        picked = z.gather(-1, local.clamp(0, self.per - 1).unsqueeze(-1)).squeeze(-1) * inside
        return reduce_sum(picked, group=self.group) - lse

    def entropy(self, temperature: float = 1.0) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as copy_to
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_sum

        z = self._scaled(self.local, temperature)
        (lse,) = self._logsumexp([z])
        logp = z - copy_to(lse, group=self.group).unsqueeze(-1)
        return -reduce_sum((logp.exp() * torch.nan_to_num(logp, neginf=0.0)).sum(-1), group=self.group)

    def generalised_jsd(self, teacher: torch.Tensor, beta: float, temperature: float = 1.0) -> torch.Tensor:
        """methods/distill.py's generalised_jsd with these logits as the student's and `teacher`
        full-vocabulary logits (each rank reads its columns) or another VocabShard."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region as copy_to
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as reduce_sum

        t_local = teacher.local if isinstance(teacher, VocabShard) else self.columns(teacher)
        zs, zt = self._scaled(self.local, temperature), self._scaled(t_local, temperature)
        lse_s, lse_t = (copy_to(x, group=self.group) for x in self._logsumexp([zs, zt]))
        ls, lt = zs - lse_s.unsqueeze(-1), zt - lse_t.unsqueeze(-1)
        real = torch.isfinite(lt)  # padded columns contribute nothing
        ls, lt = ls.masked_fill(~real, 0.0), lt.masked_fill(~real, 0.0)
        ps_, pt = ls.exp() * real, lt.exp() * real
        if beta == 0.0:
            local = (pt * (lt - ls)).sum(-1)
        elif beta == 1.0:
            local = (ps_ * (ls - lt)).sum(-1)
        else:
            lm = torch.logaddexp(ls + math.log(1.0 - beta), lt + math.log(beta))
            local = beta * (pt * (lt - lm)).sum(-1) + (1.0 - beta) * (ps_ * (ls - lm)).sum(-1)
        return reduce_sum(local, group=self.group)
