"""Fused GPU kernels patched into the HF model: `kernels=liger`.

    python -m workbench kernels=liger hardware=h200 ...     # Liger RoPE, RMSNorm, SwiGLU

Liger's kernels are Triton programs, so they need a CUDA GPU; on CPU, or when `liger-kernel`
is not installed, the run is refused before any weights load. The patch goes on the model
instance (not the transformers classes), so other models in the same process are untouched.

Fused linear cross-entropy: the workbench's `SelectiveLM` projects only the loss positions
through the head, so the HF forward that Liger patches for FLCE is never called with labels.
`linear_cross_entropy()` gives methods the fused head+loss over selected hidden states
instead; it falls back to the plain head + cross-entropy when Liger is not active.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.core.errors import missing_package
from workbench.peft.lora import base_model

CHOICES = ("none", "liger")
# What kernels=liger patches into each decoder layer.
LIGER_PATCHES = {"rope": True, "rms_norm": True, "swiglu": True,
                 "cross_entropy": False, "fused_linear_cross_entropy": False}


def require_liger():
    """The `liger_kernel.transformers` module, or the install hint."""
    try:
        import liger_kernel.transformers as lt
    except ImportError:
        raise missing_package("liger-kernel", "liger") from None
    return lt


def apply(model: torch.nn.Module, name: str, device: str) -> dict:
    """Patch the model's layers in place; returns which kernels were applied. Which choices this
    machine can run is a rule (workbench/resolve/rules.py: kernels-choice, liger-on-cpu, liger-needs-package)."""
    if name == "none":
        return {}
    lt = require_liger()

    target = base_model(model)
    lt._apply_liger_kernel_to_instance(model=target, **LIGER_PATCHES)
    global _FLCE
    _FLCE = lt.LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return {k: v for k, v in LIGER_PATCHES.items() if v} | {"fused_linear_cross_entropy_helper": True}


_FLCE = None  # set by apply(kernels=liger)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T` against `targets` (N x H, V x H, N).

    With Liger active the logits are never materialised in full (chunked fused kernel)."""
    if _FLCE is not None and hidden.is_cuda:
        return _FLCE(weight, hidden, targets)
    return F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
