"""Precision policies: which dtype parameters live in, what matmuls run in, and loss scaling.

| name        | trainable params | frozen params | compute          | loss scaling |
|-------------|------------------|---------------|------------------|--------------|
| fp32        | fp32             | fp32          | fp32             | no           |
| bf16        | bf16             | bf16          | bf16             | no           |
| bf16-mixed  | fp32 (master)    | bf16          | bf16 autocast    | no           |
| fp16        | fp32 (master)    | fp16          | fp16 autocast    | dynamic      |
| fp8         | GPU only (torchao float8 / Transformer Engine); refused on CPU              |

Frozen weights (a LoRA base) need no fp32 master copy, so mixed modes keep them in the half
dtype: less memory and no cast on every forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from workbench.errors import UserError


@dataclass(frozen=True)
class Policy:
    name: str
    load_dtype: torch.dtype  # dtype the base weights are loaded in
    trainable_dtype: torch.dtype
    frozen_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaling: bool


POLICIES = {
    "fp32": Policy("fp32", torch.float32, torch.float32, torch.float32, None, False),
    "bf16": Policy("bf16", torch.bfloat16, torch.bfloat16, torch.bfloat16, None, False),
    "bf16-mixed": Policy("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, False),
    "fp16": Policy("fp16", torch.float16, torch.float32, torch.float16, torch.float16, True),
}


def policy(name: str, device: str) -> Policy:
    if name == "fp8":
        if device != "cuda" or not torch.cuda.is_available():
            raise UserError("precision=fp8 needs an NVIDIA Hopper/Blackwell GPU (torchao float8 or "
                            "Transformer Engine); on this machine use precision=bf16-mixed")
        try:
            import torchao  # noqa: F401
        except ImportError:
            raise UserError("precision=fp8 needs torchao: pip install torchao") from None
        return Policy("fp8", torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16, False)
    return POLICIES[name]


def cast_params(model: torch.nn.Module, pol: Policy) -> None:
    """Put trainable and frozen floating-point parameters into the policy's dtypes."""
    for p in model.parameters():
        if not p.is_floating_point() or type(p).__name__ == "Params4bit":
            continue  # packed 4-bit weights stay as they are, whatever their storage dtype
        want = pol.trainable_dtype if p.requires_grad else pol.frozen_dtype
        if p.dtype != want:
            p.data = p.data.to(want)


def autocast(pol: Policy, device: str):
    if pol.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=pol.autocast_dtype)
