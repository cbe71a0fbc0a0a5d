"""The training view of a causal LM: logits only where a loss needs them.

With answer-only SFT, DPO and GRPO, most positions carry no loss; projecting every hidden state
through a 49k-vocabulary head wastes a fifth of the step on SmolLM2. `SelectiveLM` runs the
decoder, then the head on the selected positions only. It is the module backends wrap (DDP,
FSDP2, ZeRO), so their forward hooks see an ordinary `forward` call.

On CPU, training batches of short sequences run SDPA's math kernel: PyTorch's CPU flash-attention
backward is tuned for long sequences and at 50 tokens costs twice the math kernel's
(scripts/bench.py attention measures the crossover; beyond SHORT tokens flash wins).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from workbench.peft.lora import base_model

SHORT = 128  # tokens: at and below this the math kernel (forward + backward) beats flash on CPU


class SelectiveLM(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.inner = model
        lm = base_model(model)
        config = getattr(lm, "config", None)
        # Families whose CausalLM forward rescales the head's output in ways not listed here
        # (e.g. Cohere's logit_scale) take the whole forward instead of the split one.
        self._split = hasattr(lm, "model") and hasattr(lm, "lm_head") and getattr(config, "logit_scale", None) is None
        # Gemma 2/3 soft-cap their logits in the CausalLM forward: cap * tanh(logits / cap).
        self._softcap = getattr(config, "final_logit_softcapping", None) if config is not None else None

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None):
        """Logits at positions where `select` is True (N x vocab), or all logits (B x T x V)."""
        lm = base_model(self.inner)
        if right_padded(attention_mask):
            # Under a causal mask no real token attends to the padding after it, so the padding
            # mask changes nothing that is trained; without it SDPA takes its faster causal path.
            attention_mask = None
        with _attention_kernel(input_ids, getattr(lm, "is_gradient_checkpointing", False)):
            return self._forward(lm, input_ids, attention_mask, position_ids, select)

    def _forward(self, lm, input_ids, attention_mask, position_ids, select):
        if select is None or not self._split:
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)
            return out.logits if select is None else out.logits[select]
        hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        logits = lm.lm_head(hidden[select])
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits


def _attention_kernel(input_ids, checkpointing: bool):
    # Recomputation under activation checkpointing runs outside this context and must pick the
    # same kernel as the forward did, so checkpointed models keep the default.
    if (input_ids.device.type != "cpu" or input_ids.shape[-1] > SHORT or not torch.is_grad_enabled()
            or checkpointing):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def right_padded(attention_mask) -> bool:
    """A 2-D mask whose rows are ones then zeros (padding only at the end)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return False
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


def shift_targets(input_ids: torch.Tensor, labels: torch.Tensor, ignore: int = -100):
    """(select, targets): positions whose *next* token is trained, and those next tokens."""
    select = torch.zeros_like(labels, dtype=torch.bool)
    select[:, :-1] = labels[:, 1:] != ignore
    return select, labels[:, 1:][labels[:, 1:] != ignore]
