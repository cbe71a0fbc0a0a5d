"""The attention core of the workbench's Megatron layer spec, on every device: torch SDPA.

Megatron-Core's own `DotProductAttention` takes its score matrix from a global buffer allocated
on the current CUDA device, and Transformer Engine's needs a GPU; `SDPAttention` is a
MegatronModule with DotProductAttention's constructor and forward signature that calls
`torch.nn.functional.scaled_dot_product_attention` (PyTorch picks the flash / memory-efficient
kernel on a GPU, the math kernel on a CPU) and honours padding masks. `attention_mask` builds the
mask in Megatron's convention.

    core = sdp_attention()            # the class, built on first use (imports megatron.core)
    mask = attention_mask(pad_mask, seq, batch, device)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _attention_core_class():
    # Defined lazily so importing this module does not import megatron.core.
    from megatron.core.transformer.module import MegatronModule

    class SDPAttention(MegatronModule):
        """Core attention through torch SDPA: q [sq,b,np,hn], k/v [sk,b,ng,hn] -> [sq,b,np*hn].

        `attention_mask` is Megatron's convention: bool [b,1,sq,sk], True where attention is
        forbidden; None means plain causal attention.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise NotImplementedError("context parallelism needs Transformer Engine's attention (GPU)")
            tp = pg_collection.tp.size() if pg_collection is not None else _tp_size()
            self.heads = config.num_attention_heads // tp
            self.groups = config.num_query_groups // tp
            self.head_dim = config.kv_channels
            self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise NotImplementedError("packed sequences / attention bias need Transformer Engine (GPU)")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
            if self.heads != self.groups:
                rep = self.heads // self.groups
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            drop = self.dropout if self.training else 0.0
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=drop,
                                                     scale=self.scale)
            sq, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)

    return SDPAttention


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


_CLASS = None


def sdp_attention():
    """The SDPAttention class (built once, on first use)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _attention_core_class()
    return _CLASS


def attention_mask(pad_mask: torch.Tensor | None, seq: int, batch: int, device) -> torch.Tensor:
    """Megatron's bool mask [b,1,s,s] (True = blocked): causal, plus padded keys blocked.

    A query row never ends fully blocked (its own position stays open), so left-padded rows give
    finite values instead of NaN; no loss is ever read at a padded position. A 4-D mask (the
    shared-prompt rows of workbench/data/pair_tree.py, True = may attend) is taken as it is.
    """
    if pad_mask is not None and pad_mask.dim() == 4:
        return ~pad_mask.bool()
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    mask = causal.expand(batch, 1, seq, seq)
    if pad_mask is not None:
        mask = mask | ~pad_mask.bool()[:, None, None, :]
        eye = torch.eye(seq, dtype=torch.bool, device=device)
        mask = mask & ~eye
    return mask.contiguous()
