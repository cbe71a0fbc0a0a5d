"""Advantages for GRPO and RLOO: how much better each completion did than its group.

Each prompt's `num_generations` completions form a group.

`method.advantage=group` (GRPO): a completion's reward minus the group mean, divided by a
standard deviation (unbiased, + 1e-4) taken over the group (`scale_rewards=group`), over the
whole batch (`batch`), or not at all (`none`, Dr. GRPO, which argues the division biases updates
toward easy and hopeless prompts).

`method.advantage=rloo` (REINFORCE leave-one-out, Ahmadian et al. 2024; TRL's RLOOTrainer): a
completion's reward minus the mean of the other G-1 rewards of its group, a baseline that does
not depend on the completion itself. It equals G/(G-1) times the group-centred reward.
`normalize_advantages=true` then centres and scales the advantages over the batch (RLOOConfig's
option, off by default). "Batch" here, as for scale_rewards=batch, is this rank's completions of
the step (the whole step on one rank; TRL gathers the step's rewards from every rank first).

    python -m workbench method=rloo                                  # advantage=rloo
    python -m workbench method=rloo method.normalize_advantages=true
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
KINDS = ("group", "rloo")


def group_advantages(rewards: torch.Tensor, num_generations: int, scale: str = "group") -> torch.Tensor:
    """rewards: (prompts * num_generations,) in group order -> advantages of the same shape."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale!r}")
    grouped = rewards.view(-1, num_generations)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)
    if scale == "group":
        adv = adv / (grouped.std(dim=1).repeat_interleave(num_generations) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """rewards: (prompts * num_generations,) in group order -> leave-one-out advantages."""
    grouped = rewards.view(-1, num_generations)
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    adv = (grouped - baseline).reshape(-1)
    if normalize:  # over the batch; std unbiased, + 1e-4 as RLOOTrainer
        adv = (adv - adv.mean()) / (adv.std() + 1e-4)
    return adv


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """Share of groups whose completions all got the same reward (they carry no signal)."""
    grouped = rewards.view(-1, num_generations)
    return float((grouped.std(dim=1) < 1e-6).float().mean())
