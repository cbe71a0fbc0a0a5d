"""Group-relative advantages for GRPO.

Each prompt's `num_generations` completions form a group; a completion's advantage is its
reward minus the group mean, divided by a standard deviation (unbiased, + 1e-4) taken over the
group (`scale_rewards=group`, GRPO), over the whole batch (`batch`), or not at all (`none`,
Dr. GRPO, which argues the division biases updates toward easy and hopeless prompts).
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")


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


def zero_std_fraction(rewards: torch.Tensor, num_generations: int) -> float:
    """Share of groups whose completions all got the same reward (they carry no signal)."""
    grouped = rewards.view(-1, num_generations)
    return float((grouped.std(dim=1) < 1e-6).float().mean())
