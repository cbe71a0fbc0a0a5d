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

`has_signal(group_rewards)` is the one test of whether a group carries any signal.
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


def has_signal(rewards: torch.Tensor) -> bool:
    """Whether one group's rewards vary (standard deviation >= 1e-6). A group that scored every
    completion alike has zero advantage for each of them, so it adds no gradient: dynamic
    sampling drops and refills it, and the signal log counts it."""
    return bool(rewards.std() >= 1e-6)
