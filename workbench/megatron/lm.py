"""What a method's loss calls under backend=megatron: SelectiveLM's forward on a GPTModel stage.

    lm = MegatronLM(gpt, vocab, head="gather")       # logits at `select`, full vocabulary
    logits = lm(input_ids, attention_mask, position_ids, select)
    out = stage_forward(gpt, ids, mask, position_ids)  # one PP stage: hidden [s,b,h] or logits [b,s,V/tp]

`head` says what the last stage hands the loss:
- "gather": the logits at `select` all-gathered over TP to the full vocabulary (SFT, DPO, KTO,
  CPO/SimPO, ORPO, GRPO run their own log-softmax unchanged; an [N_selected, V] gather);
- "shard": a `VocabShard` of this rank's columns (workbench/megatron/vocab.py): distillation
  computes its softmaxes and divergence vocabulary-parallel, nothing of size V crosses ranks;
- "scalar": a reward model's scores (one output column, replicated over TP: nothing to gather).

Positions: GPTModel applies RoPE at 0..T-1; rows whose `position_ids` differ (one row per pair,
the prompt shared by both completions: workbench/data/pair_tree.py) get the rotary embedding of
their own positions, [s, b, 1, d] instead of [s, 1, 1, d], which Megatron-Core's unfused
`apply_rotary_pos_emb` broadcasts over the batch. Their 4-D masks go to the attention core as
they are (workbench/megatron/attention.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from workbench.megatron import lora
from workbench.megatron.attention import attention_mask as build_mask
from workbench.megatron.cpu_shim import cpu_device
from workbench.megatron.vocab import VocabShard
from workbench.models.head import target_logps


class MegatronLM(nn.Module):
    """`peft_layer`: one of the HF PeftModel's LoRA layers. PEFT's `disable_adapter()` (how a
    reference=adapter is evaluated, workbench/methods/reference.py) flips its switch; the
    Megatron adapters follow it, so the reference is the adapter-free base here too."""

    def __init__(self, model: nn.Module, vocab: int, head: str = "gather", peft_layer=None):
        super().__init__()
        self.model, self.vocab, self.head, self.peft_layer = model, vocab, head, peft_layer

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None, targets=None, slot=None,
                temperature: float = 1.0, entropy: bool = False):
        """SelectiveLM's call (workbench/models/head.py): logits, or the targets' log-probs."""
        if self.peft_layer is not None:
            lora.set_enabled(self.model, not self.peft_layer.disable_adapters)
        logits = stage_forward(self.model, input_ids, attention_mask, position_ids)
        return head_output(logits, select, self.vocab, self.head, targets, slot, temperature, entropy)


def head_output(logits, select, vocab: int, head: str, targets=None, slot=None, temperature: float = 1.0,
                entropy: bool = False):
    if select is not None:
        logits = logits[select]
    if head == "scalar":
        return logits
    if head == "shard":
        return VocabShard(logits, vocab)
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    logits = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
    return logits if targets is None else target_logps(logits, targets, slot, temperature, entropy)


def _gpt(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # Megatron-Core's DDP wraps the GPTModel as .module


@contextlib.contextmanager
def rope_positions(model: nn.Module, position_ids: torch.Tensor | None):
    """While active, the GPTModel's rotary embedding is that of `position_ids` per row."""
    if position_ids is None:
        yield
        return
    rope = _gpt(model).rotary_pos_emb
    inner = rope.forward

    def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
        emb = inner(int(position_ids.max()) + 1, offset, packed_seq, cp_group)  # [P, 1, 1, d]
        return emb[:, 0, 0][position_ids.t()].unsqueeze(2)  # [s, b, 1, d]

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward  # back to the class's


def stage_forward(model, input_ids, attention_mask, position_ids):
    """One PP stage's output: hidden states [s,b,h], or logits [b,s,V/tp] on the last stage."""
    b, s = input_ids.shape
    arange = torch.arange(s, device=input_ids.device).expand(b, s)
    own = position_ids is not None and not torch.equal(position_ids, arange)
    if own and _gpt(model).config.context_parallel_size > 1:
        raise RuntimeError("backend=megatron: rows with their own position_ids under backend.cp > 1")
    with cpu_device(), rope_positions(model, position_ids if own else None):
        return model(input_ids, arange, build_mask(attention_mask, s, b, input_ids.device))


class LogitsView(nn.Module):
    """What the method sees on the last PP stage: the logits the schedule already computed."""

    def __init__(self, logits, micro, vocab, head):
        super().__init__()
        self.logits, self.micro, self.vocab, self.head = logits, micro, vocab, head
        self.used = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None, targets=None, slot=None,
                temperature: float = 1.0, entropy: bool = False):
        if self.used or input_ids is not self.micro["input_ids"]:
            raise RuntimeError("with backend.pp > 1 a method's loss must call the model once, on micro['input_ids']")
        self.used = True
        return head_output(self.logits, select, self.vocab, self.head, targets, slot, temperature, entropy)


def pad_micro(micro: dict, length: int) -> dict:
    """Right-pad every [B, T] tensor (and a [B, 1, T, T] mask) to `length`: pads never attend
    into real tokens (a padded position attends to itself only) and are never selected."""
    ids = micro["input_ids"]
    b, t = ids.shape
    if t == length:
        return micro
    out = dict(micro)
    for k, v in micro.items():
        if not isinstance(v, torch.Tensor):
            continue
        if k == "attention_mask" and v.dim() == 4:
            m = torch.zeros(b, 1, length, length, dtype=torch.bool, device=v.device)
            m[:, :, :t, :t] = v.bool()
            idx = torch.arange(t, length, device=v.device)
            m[:, :, idx, idx] = True
            out[k] = m
        elif v.dim() >= 2 and tuple(v.shape[:2]) == (b, t):
            fill = -100 if k == "labels" else 0
            pad = v.new_full((b, length - t, *v.shape[2:]), fill)
            out[k] = torch.cat([v, pad], dim=1)
    return out
