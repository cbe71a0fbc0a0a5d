"""The policy-gradient objectives of method=grpo: importance ratio and per-token surrogate.

    python -m workbench method=gspo                                   # GSPO: sequence-level ratio
    python -m workbench method=rloo                                   # RLOO: leave-one-out baseline
    python -m workbench method=grpo method.loss_type=cispo method.epsilon_high=5.0
    python -m workbench method=grpo method.loss_type=sapo

All tensors are flat over the completion tokens of a micro-batch (row-major, as
workbench/methods/grpo.py's `token_logps` returns them); `rows` gives each token's completion.

Importance ratio (`method.importance_sampling_level`), r against the policy that sampled:
- token: r_t = pi(y_t) / pi_old(y_t), one ratio per token (GRPO, PPO).
- sequence: one ratio per completion, exp of the mean token log-ratio, i.e. the geometric mean
  of the token ratios (GSPO, Zheng et al. 2025), broadcast to the completion's tokens. The mean
  keeps the ratio near 1 whatever the length, so GSPO clips with a tiny range (3e-4 / 4e-4).
- sequence_sum: exp of the summed token log-ratio, the completion's likelihood ratio, as TRL's
  RLOOTrainer takes it.
The gradient flows through every token of the completion in the sequence levels.

Surrogate (`method.loss_type`; the names and parameters are TRL 1.16 GRPOConfig's):
- grpo, dapo, dr_grpo: -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A).
- cispo (MiniMax-M1): -sg(min(r, epsilon_high)) A log pi. The importance weight is capped and
  detached, so every token keeps a gradient (hard clipping zeroes clipped tokens' gradients);
  epsilon_high is the cap on the weight itself, not an offset from 1 (ScaleRL suggests 5.0).
- sapo (Soft Adaptive Policy Optimization): -sigmoid(tau (r - 1)) 4 / tau A, tau =
  sapo_temperature_pos where A > 0, else sapo_temperature_neg. At r = 1 its gradient is that of
  r A; off-policy tokens are attenuated smoothly instead of cut.
How the per-token losses are averaged is workbench/methods/grpo.py's (`loss_type`): grpo and
sapo per completion, dapo and cispo over the step's tokens, dr_grpo over completions x
max_new_tokens.

KL to the reference (beta > 0) is added per token here (k3 estimator, times r unless
kl_importance_correction=false), unless `kl_in_reward=true`, where it is instead subtracted
from each completion's reward before the advantages (k1 estimator log pi_old - log ref summed
over the completion, as RLOOTrainer does): see `sequence_kl`.
"""

from __future__ import annotations

import torch

from workbench.core.errors import UserError
from workbench.train import sequence_parallel

LEVELS = ("token", "sequence", "sequence_sum")
CLIPPED = ("grpo", "dapo", "dr_grpo")  # hard clipping, differing only in normalisation
LOSS_TYPES = (*CLIPPED, "cispo", "sapo")


def check(cfg) -> None:
    """The options of this module (called from grpo.check, before any weights load)."""
    if cfg.loss_type not in LOSS_TYPES:
        raise UserError(f"method.loss_type={cfg.loss_type!r} is not one of {list(LOSS_TYPES)}")
    if cfg.importance_sampling_level not in LEVELS:
        raise UserError(f"method.importance_sampling_level={cfg.importance_sampling_level!r} is not one of "
                        f"{list(LEVELS)}")
    if cfg.loss_type == "cispo" and cfg.epsilon_high is None:
        # TRL would fall back to epsilon (0.2) as the cap on the weight, scaling every gradient by <= 0.2
        raise UserError("method.loss_type=cispo caps the importance weight at method.epsilon_high: set it "
                        "(ScaleRL suggests 5.0)")
    if cfg.loss_type == "sapo" and min(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) <= 0:
        raise UserError("method.sapo_temperature_pos and method.sapo_temperature_neg must be > 0")


def ratio(logp, old_logp, rows, n_tokens, level: str):
    """Per-token importance ratio pi/pi_old at the given level (flat, like logp)."""
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    per_seq = torch.zeros(n_tokens.numel(), dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, rows, log_ratio)
    per_seq = sequence_parallel.total(per_seq)  # under backend.sp a completion's tokens span the sp group
    if level == "sequence":
        per_seq = per_seq / n_tokens.clamp(min=1)
    return torch.exp(per_seq)[rows]


def policy_loss(logp, old_logp, adv_tok, cfg, rows, n_tokens, ref_logp=None):
    """Per-token loss, clip indicators {metric name: bool per token} and the per-token KL (None
    without a KL term in the loss)."""
    r = ratio(logp, old_logp, rows, n_tokens, cfg.importance_sampling_level)
    eps_hi = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    if cfg.loss_type == "cispo":
        loss = -torch.clamp(r, max=eps_hi).detach() * adv_tok * logp
        flags = {"clip/cispo": (r > eps_hi) & (adv_tok > 0)}
    elif cfg.loss_type == "sapo":
        tau = torch.where(adv_tok > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv_tok
        flags = {}  # no hard clipping
    else:
        clipped = torch.clamp(r, 1 - cfg.epsilon, 1 + eps_hi)
        loss = -torch.min(r * adv_tok, clipped * adv_tok)
        low = (r < 1 - cfg.epsilon) & (adv_tok < 0)
        high = (r > 1 + eps_hi) & (adv_tok > 0)
        flags = {"clip/low": low, "clip/high": high, "clip/region": low | high}
    kl = None
    if cfg.beta and not cfg.kl_in_reward:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        if cfg.kl_importance_correction:
            kl = kl * r
        loss = loss + cfg.beta * kl
    return loss, flags, kl


def sequence_kl(old_logp, ref_logp, rows, n_rows: int):
    """Per completion, the summed k1 estimate log pi_old - log ref of KL(pi || ref) (no gradient):
    what kl_in_reward subtracts (times beta) from the reward. Unlike k3, k1 can be negative per
    token; RLOOTrainer takes it from the RLOO paper (Ahmadian et al. 2024)."""
    d = (old_logp - ref_logp).detach()
    return torch.zeros(n_rows, dtype=d.dtype, device=d.device).index_add(0, rows, d)
