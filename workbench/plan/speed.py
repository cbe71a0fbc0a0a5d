"""Throughput, time and cost from FLOPs: 6·N per trained token (frozen base: 4·N + 2·N_trainable),
plus the reference forward of DPO (2·N) and GRPO's generation (2·N per generated token), at a
model-FLOPs utilisation (MFU) the user sets with plan.mfu.

    tokens/s = devices x peak FLOP/s x MFU / FLOPs per token
    hours    = tokens / tokens/s / 3600;  cost = hours x devices x $/device-hour

Worked example (tests/unit/test_plan.py): 70B on 1T tokens on 256 H100 in fp8 at 38% MFU is
about 25 days = 153,600 GPU-hours, about $460k at $3/h.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.methods import registry


def train_flops_per_token(n_active: float, n_trainable: float, peft: str, method: str = "sft",
                          ref: str = "none") -> float:
    flops = 6.0 * n_active if peft == "none" else 4.0 * n_active + 2.0 * n_trainable
    need = registry.spec(method).facts
    if ref in ("adapter", "copy"):
        flops += 2.0 * n_active  # the reference model's forward pass
    if need.teacher:
        flops += 2.0 * n_active  # the teacher's forward pass (a teacher of the student's size)
    if need.generates:
        flops += 2.0 * n_active  # generating the completion (decode is slower than this)
    return flops


@dataclass(frozen=True)
class Speed:
    tokens_per_s: float
    hours: float
    device_hours: float
    cost: tuple[float, float] | None  # (low, high) USD for the whole run

    @property
    def days(self) -> float:
        return self.hours / 24


def speed(tokens: float, flops_per_token: float, devices: int, peak_tflops: float, mfu: float,
          price: list[float] | tuple | None) -> Speed | None:
    if peak_tflops <= 0 or flops_per_token <= 0 or mfu <= 0:
        return None
    tps = devices * peak_tflops * 1e12 * mfu / flops_per_token
    hours = tokens / tps / 3600
    cost = (hours * devices * price[0], hours * devices * price[-1]) if price else None
    return Speed(tokens_per_s=tps, hours=hours, device_hours=hours * devices, cost=cost)


def cost_per_million_tokens(tokens_per_s: float, devices: int, price_per_hour: float) -> float:
    """USD per million trained tokens at a measured throughput."""
    return devices * price_per_hour / (tokens_per_s * 3600) * 1e6
