"""What lets Megatron-Core's GPTModel run forward and backward without CUDA (CPU, gloo).

Megatron-Core 0.16 assumes a GPU in three places this workbench meets:

1. `DotProductAttention` takes its score matrix from `get_global_memory_buffer()`, a buffer
   allocated on `torch.cuda.current_device()`. That buffer is not shimmed: the layer spec built
   in `workbench.megatron.model` uses the attention core of workbench/megatron/attention.py
   (torch SDPA) on every device.
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

4. Megatron-Core's own optimizer (the distributed optimizer, its grad clipping) allocates with
   `torch.tensor(..., device="cuda")` (found_inf, the overflow buffer, the grad-norm fallback:
   optimizer/optimizer.py:473-485, utils.py:1207) and compares `Tensor.type()` with
   "torch.cuda.FloatTensor" and its kin (distrib_optimizer.py:361, clip_grads.py:167).
   `optimizer_cpu()` allocates those on the CPU and reports a CPU tensor's type under its CUDA
   name; it is process-global while active, so the backend enters it only around building the
   optimizer, finalising gradients, stepping and reading or writing its state, never around a
   forward or backward pass.

Not CUDA but found the same way: without Transformer Engine, Megatron-Core 0.16.1's MoE router
reads a module global `te_general_gemm` that was never defined (NameError); `patch_missing_te()`
defines it as None, which selects the plain PyTorch router matmul. MoE on CPU also uses the
"allgather" token dispatcher (the "alltoall" one creates a CUDA stream in its constructor).

5. The tensor-parallel linear layers are autograd Functions decorated with
   `torch.amp.custom_fwd/custom_bwd(device_type="cuda")` (tensor_parallel/layers.py:68): the
   backward re-enters the forward's *CUDA* autocast state, so on a GPU `grad_output @ weight`
   runs in bf16 whatever the weight's dtype. On the CPU the backward runs outside any autocast
   (the schedule calls it after the forward's `torch.autocast` block has closed), and with fp32
   weights under bf16 autocast (precision=bf16-mixed, full fine-tuning) the bf16 gradient meets
   the fp32 weight: "expected m1 and m2 to have the same dtype". `patch_cpu_autocast()`
   re-decorates the same functions for the CPU's autocast, which is what Megatron does for CUDA.

    with cpu_device():
        model = build_gpt(...)
        logits = model(input_ids, position_ids, mask)
"""

from __future__ import annotations

import contextlib

import torch


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


def patch_cpu_autocast() -> None:
    """Make Megatron-Core's tensor-parallel linear Functions carry the forward's CPU autocast
    state into their backward, as they do for CUDA (item 5 above). Idempotent; no-op on GPU."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import layers

    for fn in (layers.LinearWithFrozenWeight, layers.LinearWithGradAccumulationAndAsyncCommunication):
        if getattr(fn, "_workbench_cpu_autocast", False):
            continue
        # custom_fwd/custom_bwd wrap with functools.wraps: __wrapped__ is Megatron's own function
        fwd, bwd = fn.forward.__wrapped__, fn.backward.__wrapped__
        fn.forward = staticmethod(torch.amp.custom_fwd(fwd, device_type="cpu"))
        fn.backward = staticmethod(torch.amp.custom_bwd(bwd, device_type="cpu"))
        fn._workbench_cpu_autocast = True


def patch_missing_te() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def optimizer_cpu():
    """Route Megatron-Core's optimizer's CUDA allocations and type checks to the CPU (no-op on GPU)."""
    if torch.cuda.is_available():
        yield
        return
    saved = (torch.tensor, torch.Tensor.type)
    tensor, type_of = torch.tensor, torch.Tensor.type

    def make(data, *a, device=None, **k):
        device = "cpu" if device == "cuda" else device
        if _nested_tensors(data):  # Megatron's local multi_tensor_l2norm: torch.tensor of per-tensor norms
            return _stack(data).to(*a, device=device, **k)
        return tensor(data, *a, device=device, **k)

    torch.tensor = make

    def cuda_type(self, *a, **k):
        out = type_of(self, *a, **k)
        if not a and not k and isinstance(out, str) and out.startswith("torch.") and not self.is_cuda:
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = cuda_type
    try:
        yield
    finally:
        torch.tensor, torch.Tensor.type = saved


def _nested_tensors(data) -> bool:
    """A (nested) list of tensors: torch.tensor reads their values one by one, which tensors
    without data (dry_run=trace's fake ones) refuse; stacking them gives the same tensor."""
    while isinstance(data, (list, tuple)) and data:
        data = data[0]
    return isinstance(data, torch.Tensor)


def _stack(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data
    return torch.stack([_stack(x) for x in data])
