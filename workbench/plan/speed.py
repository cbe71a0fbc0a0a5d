"""Throughput, time and cost: 6·N FLOPs per trained token (frozen base: 4·N + 2·N_trainable),
plus the reference forward of DPO (2·N) and a teacher's, at a model-FLOPs utilisation (MFU) the
user sets with plan.mfu; and, for a method that trains on rollouts (GRPO), the time of
generating them, which FLOPs do not describe (`generation_seconds`).

    tokens/s = devices x tokens per device-second;  hours = tokens / tokens/s / 3600
    cost     = hours x devices x $/device-hour  (the whole job on all the cluster's devices)

Generation: a prefill of the prompts (compute-bound, 2·N per prompt token at the MFU) and one
decode step per generated token, each a forward of all the rank's completions over one new
token with the KV cache: bound by reading every weight once (weight bytes / memory bandwidth)
or, for many rows, by their 2·N FLOPs each, plus a fixed cost per decode step (the loop and
its kernel launches or, on a CPU, its Python and operator dispatch, per decoder block).

Worked example (tests/unit/test_plan.py): 70B on 1T tokens on 256 H100 in fp8 at 38% MFU is
about 25 days = 153,600 GPU-hours, about $460k at $3/h.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.methods import registry
from workbench.peft.kind import Peft


def train_flops_per_token(n_active: float, n_trainable: float, peft: str, method: str = "sft",
                          ref: str = "none", generation: bool = True, old_logps: bool = False) -> float:
    """FLOPs per trained token. generation=False: a method that generates leaves its generation
    to `generation_seconds`; old_logps: a forward for the generating policy's log-probs."""
    flops = 4.0 * n_active + 2.0 * n_trainable if Peft(peft).adapter else 6.0 * n_active
    need = registry.spec(method).facts
    if ref in ("adapter", "copy"):
        flops += 2.0 * n_active  # the reference model's forward pass
    if need.teacher:
        flops += 2.0 * n_active  # the teacher's forward pass (a teacher of the student's size)
    if need.generates and generation:
        flops += 2.0 * n_active  # generating the completion (decode is slower than this)
    if old_logps:
        flops += 2.0 * n_active
    return flops


@dataclass(frozen=True)
class Rollout:
    """What one rank generates per optimizer step."""

    prefill_tokens: float  # prompt tokens prefilled (each distinct prompt once)
    decode_steps: float  # forwards over one new token (max_new_tokens per generate call)
    rows: float  # completions each decode step carries
    calls: float = 1.0  # generate calls (dynamic sampling refills with more)


@dataclass(frozen=True)
class Decoder:
    """How fast a device generates: the FLOP/s its decode steps reach, its memory bandwidth in
    bytes/s (0: unknown, FLOPs alone), the fixed cost of a decode step, the FLOP/s of the
    prefill, a batched forward like training's (0: as decode), and the fixed cost of a generate
    call (its setup: padding, the cache, the sampler)."""

    flops: float
    bandwidth: float
    step_s: float
    prefill_flops: float = 0.0
    call_s: float = 0.0


def generation_seconds(r: Rollout, n_active: float, weight_bytes: float, d: Decoder) -> float:
    """Seconds one rank spends generating per optimizer step (see the module docstring)."""
    if d.flops <= 0:
        return 0.0
    prefill = r.prefill_tokens * 2.0 * n_active / (d.prefill_flops or d.flops)
    read = weight_bytes / d.bandwidth if d.bandwidth > 0 else 0.0
    per_step = max(read, r.rows * 2.0 * n_active / d.flops) + d.step_s
    return prefill + r.decode_steps * per_step + r.calls * d.call_s


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
          price: list[float] | tuple | None, extra_seconds_per_token: float = 0.0) -> Speed | None:
    """The whole job on `devices` devices: tokens/s of all of them, hours, device-hours and
    cost. extra_seconds_per_token: per device, beside the FLOPs (a rollout's generation)."""
    if peak_tflops <= 0 or flops_per_token <= 0 or mfu <= 0:
        return None
    tps = devices / (flops_per_token / (peak_tflops * 1e12 * mfu) + extra_seconds_per_token)
    hours = tokens / tps / 3600
    cost = (hours * devices * price[0], hours * devices * price[-1]) if price else None
    return Speed(tokens_per_s=tps, hours=hours, device_hours=hours * devices, cost=cost)


def cost_per_million_tokens(tokens_per_s: float, devices: int, price_per_hour: float) -> float:
    """USD per million trained tokens at a measured throughput."""
    return devices * price_per_hour / (tokens_per_s * 3600) * 1e6
