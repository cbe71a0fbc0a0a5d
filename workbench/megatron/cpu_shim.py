"""What lets Megatron-Core's GPTModel run forward and backward without CUDA (CPU, gloo).

Megatron-Core 0.16 assumes a GPU in three places this workbench meets:

1. `DotProductAttention` takes its score matrix from `get_global_memory_buffer()`, a buffer
   allocated on `torch.cuda.current_device()`. We do not shim that buffer: the layer spec built
   in `workbench.megatron.model` swaps the attention core for `SDPAttention` below, a
   MegatronModule with DotProductAttention's constructor and forward signature that calls
   `torch.nn.functional.scaled_dot_product_attention` and honours padding masks. It is used
   on GPU too (PyTorch picks the flash / memory-efficient kernel there).
2. `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()` on every
   forward, a few constructors allocate there, and with PP the tied output layer is moved with
   `.cuda()` before its first all-reduce. `cpu_device()` makes `torch.cuda.current_device()`
   answer "cpu" and `Tensor.cuda()` return the tensor itself while it is active, only when CUDA
   is not available; the backend enters it around building, forward and backward. The pipeline
   schedules also count tokens in `torch.zeros(..., device="cuda")` and the p2p code calls
   `torch.cuda.synchronize()`: inside `cpu_device()` those allocate on the CPU / do nothing.
3. Activation recompute saves and restores the *CUDA* RNG state
   (`tensor_parallel.random._get_cuda_rng_state`). Inside `cpu_device()` those read and write the
   CPU generator instead, so recomputed forwards see the same random stream.

Not CUDA but found the same way: without Transformer Engine, Megatron-Core 0.16.1's MoE router
reads a module global `te_general_gemm` that was never defined (NameError); `patch_missing_te()`
defines it as None, which selects the plain PyTorch router matmul. MoE on CPU also uses the
"allgather" token dispatcher (the "alltoall" one creates a CUDA stream in its constructor).

    with cpu_device():
        model = build_gpt(...)
        logits = model(input_ids, position_ids, mask)
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def cpu_device():
    """Route Megatron-Core's CUDA device and RNG lookups to the CPU while active (no-op on GPU)."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.tensor_parallel import random as mrandom

    saved = (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state,
             torch.Tensor.cuda, torch.zeros, torch.cuda.synchronize)
    zeros = torch.zeros
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.zeros = lambda *a, device=None, **k: zeros(*a, device="cpu" if device == "cuda" else device, **k)
    torch.cuda.synchronize = lambda *a, **k: None
    mrandom._get_cuda_rng_state = lambda *a, clone=False, **k: torch.get_rng_state().clone()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    try:
        yield
    finally:
        (torch.cuda.current_device, mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state,
         torch.Tensor.cuda, torch.zeros, torch.cuda.synchronize) = saved


def patch_missing_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
    finite values instead of NaN; no loss is ever read at a padded position.
    """
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    mask = causal.expand(batch, 1, seq, seq)
    if pad_mask is not None:
        mask = mask | ~pad_mask.bool()[:, None, None, :]
        eye = torch.eye(seq, dtype=torch.bool, device=device)
        mask = mask & ~eye
    return mask.contiguous()
