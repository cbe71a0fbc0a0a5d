"""Optimizer and learning-rate schedule from `optim=` (shared by every backend)."""

from __future__ import annotations

import math

import torch

from workbench.core.errors import UserError

OPTIMIZERS = ("adamw", "sgd")  # optim.name: what build_optimizer builds
SCHEDULERS = ("constant", "linear", "cosine")  # optim.scheduler: the decays lr_factor knows


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise RuntimeError("no trainable parameters")
    if cfg.name == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    raise UserError(f"optim.name={cfg.name!r} is not one of {', '.join(OPTIMIZERS)}")


def lr_factor(step: int, cfg, max_steps: int) -> float:
    """Multiplier on optim.lr at `step` (0-based): linear warmup, then the chosen decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant" or max_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    floor = cfg.min_lr_ratio
    if cfg.scheduler == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, cfg, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, max_steps))
