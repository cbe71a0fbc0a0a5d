"""The training view of a causal LM: logits only where a loss needs them.

With answer-only SFT, DPO and GRPO, most positions carry no loss; projecting every hidden state
through a 49k-vocabulary head wastes a fifth of the step on SmolLM2. `SelectiveLM` runs the
decoder, then the head on the selected positions only. It is the module backends wrap (DDP,
FSDP2, ZeRO), so their forward hooks see an ordinary `forward` call.

Given the targets, it returns their log-probs instead of logits, and with `chunk` tokens per
piece (model.loss_chunk) it never holds the (positions x vocabulary) logits at once: each piece
runs head, log-softmax and gather under activation checkpointing, so the forward keeps one
piece's logits at a time and the backward recomputes them piece by piece (the memory of a
128k-vocabulary model's loss at 32k tokens drops from 16 GB of fp32 logits to a piece's). The
split is the one Liger's and Unsloth's fused losses make, in plain PyTorch: the head's matmul
and the log-softmax are computed as before, once more in the backward.

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
    def __init__(self, model: nn.Module, chunk: int = 0):
        super().__init__()
        self.inner = model
        self.chunk = chunk  # model.loss_chunk: positions per piece of the head with targets; 0: all at once
        # SDPA's math kernel for short CPU training sequences (below); off where another thread runs
        # the model meanwhile (async rollouts): the kernel choice is a process-wide flag
        self.math_for_short = True
        lm = base_model(model)
        config = getattr(lm, "config", None)
        # Families whose CausalLM forward rescales the head's output in ways not listed here
        # (e.g. Cohere's logit_scale) take the whole forward instead of the split one.
        self._split = hasattr(lm, "model") and hasattr(lm, "lm_head") and getattr(config, "logit_scale", None) is None
        # Gemma 2/3 soft-cap their logits in the CausalLM forward: cap * tanh(logits / cap).
        self._softcap = getattr(config, "final_logit_softcapping", None) if config is not None else None

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None, targets=None,
                slot=None, temperature: float = 1.0, entropy: bool = False):
        """Logits at positions where `select` is True (N x vocab), or all logits (B x T x V).
        With `targets`: their log-probs under logits / temperature instead, one per target, read
        at the selected positions in order or, with `slot`, at selected position slot[i] (tree
        rows read a shared prompt's last position twice); with entropy=True also each read
        position's entropy (no gradient)."""
        return _not_views(self._outputs(input_ids, attention_mask, position_ids, select, targets, slot,
                                        temperature, entropy))

    def _outputs(self, input_ids, attention_mask, position_ids, select, targets, slot, temperature, entropy):
        lm = base_model(self.inner)
        if right_padded(attention_mask):
            # Under a causal mask no real token attends to the padding after it, so the padding
            # mask changes nothing that is trained; without it SDPA takes its faster causal path.
            attention_mask = None
        with _attention_kernel(input_ids, getattr(lm, "is_gradient_checkpointing", False) or not self.math_for_short):
            if targets is None:
                return self._forward(lm, input_ids, attention_mask, position_ids, select)
            if not self._split:
                logits = self._forward(lm, input_ids, attention_mask, position_ids, select)
                return target_logps(logits, targets, slot, temperature, entropy)
            hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=False).last_hidden_state[select]
            return self._pieces(lm.lm_head, hidden if slot is None else hidden[slot], targets, temperature, entropy)

    def _pieces(self, head, hidden, targets, temperature, entropy):
        """Target log-probs (and entropies) `chunk` positions at a time, each piece checkpointed."""
        from torch.utils.checkpoint import checkpoint

        def piece(h, t):
            logits = head(h)
            if self._softcap:
                logits = torch.tanh(logits / self._softcap) * self._softcap
            return target_logps(logits, t, None, temperature, entropy)

        n = hidden.shape[0]
        if not self.chunk or n <= self.chunk:
            return piece(hidden, targets)
        out = [checkpoint(piece, hidden[i:i + self.chunk], targets[i:i + self.chunk], use_reentrant=False)
               for i in range(0, n, self.chunk)]
        if entropy:
            return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
        return torch.cat(out)

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


def _not_views(out):
    """`out` with every tensor that needs a gradient and is a view of another replaced by a copy.

    This module is the one backends wrap, and FSDP2 attaches its pre-backward hook to the
    forward's output tensors; an in-place op on an output that is a view (the target log-probs
    are `gather(...).squeeze(-1)`) would replace the view's autograd node and drop that hook
    (the backward then fails: "setStorage: ... out of bounds for storage of size 0"), so FSDP2
    warns on every forward that returns one. No caller here modifies the output in place, but the
    copy (one number per selected position, next to a log-softmax over the vocabulary at each)
    removes the hazard and the warning; tests/distributed/test_fsdp2_views.py watches both.
    Outputs without gradient (evaluation, rollouts) carry no hook and stay as they are."""
    if isinstance(out, tuple):
        return tuple(_not_views(o) for o in out)
    return out.clone() if isinstance(out, torch.Tensor) and out.requires_grad and out._base is not None else out


def target_logps(logits, targets, slot=None, temperature: float = 1.0, entropy: bool = False):
    """The targets' log-probs under logits / temperature (read at rows `slot` when given), with
    each read row's entropy (no gradient) when asked: what SelectiveLM returns given targets."""
    if slot is not None:
        logits = logits[slot]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked
    with torch.no_grad():
        return picked, -(logp.exp() * logp).sum(-1)


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
