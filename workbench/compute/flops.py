"""Training FLOPs counted as computed, from the model's own shapes and each step's batch.

    from workbench.compute.flops import FlopCount
    count = FlopCount.from_model(model, cfg)      # once, after adapters are applied
    count.step(batch.micro, batch.forward_passes)  # FLOPs this rank spent on one optimizer step
    count.per_token(seq_len=128, head_fraction=0.2)   # the same rule for one average token

What is counted (a multiply-add is 2 FLOPs):
- every matmul weight W (in x out) of the decoder blocks, per position the blocks run on
  (padding included: it is computed): forward 2W; backward 2W for the input gradient, and 2W
  more for the weight gradient only when W is trainable. Under LoRA the frozen base gets
  4W, each adapter matrix 6W. QLoRA's base is counted at its logical in x out shape. With
  frozen embeddings the first block's q/k/v projections get no input gradient (autograd skips
  it: nothing before them trains).
- attention scores, QK^T and AV, at the micro-batch's padded sequence length T: 4*T*T*width
  per row and layer forward (width = heads x head_dim), twice that backward. The full T x T
  square is counted (what SDPA's math kernel computes; the runner uses it for short CPU
  batches). Flash kernels skip masked blocks, so there the figure is up to half the attention
  term high: the PaLM/Megatron MFU convention.
- the LM head (hidden x vocab) only on the positions where it runs: SelectiveLM projects only
  the positions that carry a loss (`micro["select"]`), so only those are counted; forward and
  input gradient always, the weight gradient when the head is trainable (tied embeddings under
  full fine-tuning).
- the embedding lookup costs nothing (a gather), nor does its gradient (a scatter-add).
- a DPO reference (adapter disabled or a frozen copy) and a GRPO KL reference add one forward
  pass per micro-batch; KTO's KL pairs (`micro["kl_input_ids"]`) a forward pass of the policy
  and one of its reference, without gradient.
- the forward passes a step runs besides its micro-batches (`StepBatch.forward_passes`,
  workbench.train.batch.Forward): the rollouts of GRPO and on-policy distillation with HF generate
  (the shared prefill, or HF's own prefill with the head on each row's last position, then one
  decode step per generated token, attending to the prompt and the tokens so far) and GRPO's
  old-log-prob passes. Rollouts on vLLM, the finished ranks' extra steps under synced
  generation, a distillation teacher's forward, activation-checkpoint recomputation and DoRA's
  per-step weight norm are not counted, so the MFU of such runs is a lower bound rather than an
  overestimate.
- MoE expert weights count top-k/experts of their size (each token runs k experts).
Model-parallel ranks (Megatron TP/PP) each do 1/(tp*pp) of the work of their batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

# The first decoder block's projections that read the block input (and their LoRA A matrices).
FIRST_INPUTS = re.compile(r"layers\.0\.self_attn\.(q_proj|k_proj|v_proj)(\.base_layer|\.lora_A\.[^.]+)?$")


@dataclass
class FlopCount:
    block_weights: float  # logical weight elements of the decoder-block matmuls (MoE: active share)
    block_trainable: float  # those of them that get a weight gradient
    no_input_grad: float = 0.0  # of them, those whose input needs no gradient (see from_model)
    head_weights: float = 0.0  # hidden x vocab
    head_trainable: bool = False
    layers: int = 0
    attn_width: int = 0  # query heads x head_dim
    ref_weights: float = 0.0  # block weights a reference forward runs (0: no reference pass)
    head_everywhere: bool = False  # the head runs on every position (no SelectiveLM split)
    model_parallel: int = 1

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_model(cls, model: nn.Module, run=None) -> FlopCount:
        """Walk the (PEFT-wrapped) model once; the resolved `run` (workbench/resolve/resolved.py) adds the
        method's reference passes and the backend's model-parallel degree."""
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
        head_ids = {id(m) for m in head.modules()} if head is not None else set()
        conf = getattr(lm, "config", None)
        experts = getattr(conf, "num_local_experts", 0) or getattr(conf, "num_experts", 0) or 0
        top_k = getattr(conf, "num_experts_per_tok", 0) or 0
        share = (top_k / experts) if experts and top_k else 1.0

        blocks = trainable = skipped = 0.0
        # With frozen embeddings (and no activation checkpointing, which makes the embedding
        # output require grad) nothing upstream of the first block's q/k/v projections trains,
        # so autograd computes no input gradient for them.
        embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
        frozen_input = (embed is not None and not any(p.requires_grad for p in embed.parameters())
                        and not getattr(lm, "is_gradient_checkpointing", False))
        seen: set[int] = set()
        for name, mod in lm.named_modules():
            if id(mod) in head_ids or not isinstance(mod, nn.Linear):
                continue
            w = float(mod.in_features * mod.out_features)
            scale = share if ".experts." in f".{name}." else 1.0
            blocks += w * scale
            if mod.weight.requires_grad:
                trainable += w * scale
            if frozen_input and FIRST_INPUTS.search(name):
                skipped += w * scale
            seen.add(id(mod.weight))
        # Fused expert tensors (transformers 5 MoE: [experts, out, in] parameters, not Linear).
        for name, p in lm.named_parameters():
            if id(p) not in seen and p.dim() == 3 and "expert" in name:
                blocks += p.numel() * share
                trainable += p.numel() * share if p.requires_grad else 0.0

        head_w, head_train = 0.0, False
        if head is not None:
            base = getattr(head, "base_layer", head)
            head_w = float(base.in_features * base.out_features)
            head_train = any(p.requires_grad for p in head.parameters())
        layers = int(getattr(conf, "num_hidden_layers", 0) or 0)
        heads = int(getattr(conf, "num_attention_heads", 0) or 0)
        head_dim = getattr(conf, "head_dim", None) or (int(conf.hidden_size) // heads if heads else 0)
        count = cls(blocks, trainable, skipped, head_w, head_train, layers, heads * int(head_dim))
        # SelectiveLM projects only selected positions when it can split decoder and head
        count.head_everywhere = not (hasattr(lm, "model") and hasattr(lm, "lm_head"))
        if run is not None:
            count.ref_weights = _reference_weights(run.reference, blocks, trainable)
            count.model_parallel = run.layout.tp * run.layout.pp
            # a backend whose output layer projects every position (Megatron's GPTModel)
            count.head_everywhere |= run.backend_facts.head_every_position
        return count

    # -- counting ------------------------------------------------------------------------
    def micro(self, rows: int, seq: int, head_positions: int) -> float:
        """FLOPs of forward + backward on one micro-batch of `rows` x `seq` positions whose head
        runs on `head_positions` of them."""
        positions = rows * seq
        blocks = (4.0 * self.block_weights + 2.0 * self.block_trainable - 2.0 * self.no_input_grad) * positions
        attention = 12.0 * self.layers * self.attn_width * seq * seq * rows
        head = (4.0 + (2.0 if self.head_trainable else 0.0)) * self.head_weights * head_positions
        total = blocks + attention + head
        if self.ref_weights:
            total += (2.0 * self.ref_weights * positions + 4.0 * self.layers * self.attn_width * seq * seq * rows
                      + 2.0 * self.head_weights * head_positions)
        return total

    def forward(self, rows: int, seq: int, head_positions: int) -> float:
        """FLOPs of a forward pass without gradient over `rows` x `seq` positions, the head on
        `head_positions`, and of the reference's forward over them when there is one."""
        passes = [self.block_weights] + ([self.ref_weights] if self.ref_weights else [])
        return sum(self._no_grad(w, rows, seq, seq, head_positions) for w in passes)

    def _no_grad(self, weights: float, rows: int, seq: int, ctx: int, heads: int) -> float:
        """One forward without gradient through `weights` block weights: rows x seq new positions
        attending to ctx positions each (QK^T and AV: 4 x ctx x width per position and layer)."""
        return (2.0 * weights * rows * seq + 4.0 * self.layers * self.attn_width * seq * ctx * rows
                + 2.0 * self.head_weights * heads)

    def passes(self, forward_passes) -> float:
        """FLOPs of the policy's forward passes a step ran besides training (workbench.train.batch.Forward)."""
        return sum(self._no_grad(self.block_weights, f.rows, f.seq, f.ctx, f.heads) for f in forward_passes)

    def step(self, micro_batches, forward_passes=()) -> float:
        """FLOPs this rank computes for one optimizer step (its micro-batches, and the forward
        passes without gradient it ran besides them)."""
        total = self.passes(forward_passes)
        for m in micro_batches:
            ids = m["input_ids"]
            rows, seq = (1, int(ids.shape[-1])) if ids.dim() == 1 else (int(ids.shape[0]), int(ids.shape[-1]))
            sel = m.get("select")
            heads = rows * seq if sel is None or self.head_everywhere else int(torch.as_tensor(sel).sum())
            total += self.micro(rows, seq, heads)
            kl = m.get("kl_input_ids")
            if kl is not None:  # KTO's mismatched pairs: forward only
                heads = kl.numel() if self.head_everywhere else int(torch.as_tensor(m["kl_select"]).sum())
                total += self.forward(int(kl.shape[0]), int(kl.shape[-1]), heads)
        return total / self.model_parallel

    def per_token(self, seq_len: int, head_fraction: float = 1.0) -> float:
        """Training FLOPs per position at sequence length `seq_len`, the head on `head_fraction`
        of the positions (scripts/bench.py and the planner's way of asking)."""
        return self.micro(1, seq_len, 0) / seq_len + head_fraction * (
            (4.0 + (2.0 if self.head_trainable else 0.0) + (2.0 if self.ref_weights else 0.0)) * self.head_weights)


def _reference_weights(reference: str, blocks: float, trainable: float) -> float:
    """Block weights a per-step reference forward runs through: the base without its adapters
    (adapter disabled) or a full frozen copy; 0 when no reference pass runs during training
    (none, or log-probs precomputed before it)."""
    return {"adapter": blocks - trainable, "copy": blocks}.get(reference, 0.0)
