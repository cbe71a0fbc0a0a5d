"""What autograd keeps from the forward pass of a Llama-family decoder, per token per block.

Counted tensor by tensor from the Hugging Face Llama/Mixtral blocks (RMSNorm in fp32, SDPA, gated
MLP) and peft's LoRA layers, for the three ways a run can hold its weights:

    fp32          everything fp32
    autocast      bf16-mixed / fp16 / fp8 on one device: fp32 parameters, half-precision matmuls
                  under torch.autocast, which casts each Linear's input (and weight) separately
    half          parameters already in the compute dtype: precision=bf16, DeepSpeed and Megatron's
                  bf16 params, FSDP2's MixedPrecisionPolicy (all-gathered in bf16)

The two attention kernels save different things: flash / memory-efficient keep q, k, v (k and v
not expanded across grouped-query heads), the output and the log-sum-exp; the math kernel, which
`workbench.models.head` picks on CPU for short training batches, keeps the scaled q and k and the
expanded v in fp32 and the (heads x seq) attention probabilities.

`tests/unit/test_plan_activations.py` holds these counts against the tensors autograd actually
saves (torch.autograd.graph.saved_tensors_hooks) for every precision x peft x kernel.
"""

from __future__ import annotations

from workbench.compute.precision import POLICIES
from workbench.families import registry as families
from workbench.families.llama import SPEC as LLAMA

# SHORT: the longest batch that runs the math kernel on CPU
from workbench.models.head import SHORT
from workbench.plan.setup import Setup

# bytes per element by precision name, from the policies themselves (workbench/compute/precision.py)
COMPUTE = {name: pol.bytes("compute") for name, pol in POLICIES.items()}
LORA_TARGETS = 7  # all-linear on a Llama block: q, k, v, o, gate, up, down


def weight_mode(s: Setup) -> str:
    """fp32 | autocast | half: how the block's matmuls see their weights (see the module docstring)."""
    if s.precision == "fp32":
        return "fp32"
    if s.precision == "bf16" or s.facts.half_compute:
        return "half"
    return "autocast"


def math_attention(s: Setup, seq: int) -> bool:
    """Does training attention run SDPA's math kernel? (CPU, short batches, no recomputation)."""
    return s.device == "cpu" and s.checkpointing == "none" and seq <= SHORT


def residual_bytes(s: Setup) -> int:
    """Bytes per element of the residual stream (the blocks' inputs and outputs)."""
    if s.precision == "fp32" or (not s.adapter and weight_mode(s) == "autocast"):
        return 4  # fp32 embedding output plus half-precision matmul outputs stays fp32
    return 2


def block_bytes(arch, s: Setup, seq: int, math: bool | None = None) -> float:
    """Bytes saved per token by one decoder block; `seq` is the batch's padded sequence length,
    `math` whether attention runs the math kernel (default: as workbench.models.head picks)."""
    return sum(block_parts(arch, s, seq, math))


def block_parts(arch, s: Setup, seq: int, math: bool | None = None) -> tuple[float, float]:
    """block_bytes as (what tensor parallelism replicates on every TP rank: the norms, their
    outputs that the column-parallel linears read, the adapters' low-rank outputs; what it shards
    by heads and by the MLP's width: attention's tensors and the MLP's)."""
    h, heads, inter = arch.hidden, arch.heads, arch.intermediate
    d = arch.head_dim or h // heads
    q, kv = heads * d, (arch.kv_heads or heads) * d
    c = COMPUTE[s.precision]
    mode = weight_mode(s)
    adapters = s.adapter
    fam = families.get(arch.family) or LLAMA
    # Each RMSNorm keeps an fp32 view of its input (the input itself when the stream is fp32, an
    # upcast copy otherwise) and 1/rms; with a trainable weight also the normalised input (in fp32
    # where the family scales in fp32: Gemma's 1 + w).
    scaled = 0 if adapters else (4 if fam.norm_in_fp32 else residual_bytes(s))
    norms = fam.norms_per_block * (4 * h + 4 + scaled * h)
    if fam.qk_norm:  # the same per head of q and k (Qwen3, Gemma 3), its scale in the compute dtype
        kv_heads = arch.kv_heads or heads
        norms += 4 * (q + kv) + 4 * (heads + kv_heads) + (0 if adapters else (4 if fam.norm_in_fp32 else c) * (q + kv))
    # What the Linear layers keep of their inputs. Autocast casts the input once per Linear (q, k
    # and v each; gate and up each); with LoRA, peft casts to the adapter's fp32 first, so the
    # frozen layers' inputs are copied for every adapter, o_proj's included.
    if mode == "autocast":
        inputs = (5 * h + (q if adapters else 0)) * c
    else:
        inputs = 2 * h * c  # each norm's output, shared by the Linears that read it
    if adapters:
        inputs += LORA_TARGETS * s.lora_r * c  # adapter A outputs
    if math_attention(s, seq) if math is None else math:
        # fp32 even for half-precision inputs; o_proj's input is a transposed copy of the output
        # (already counted above when autocast copies it for an adapter)
        attention = 3 * 4 * q + 4 * heads * seq + (0 if adapters and mode == "autocast" else q * c)
    else:
        attention = (2 * q + 2 * kv) * c + 4 * heads  # q, k, v, output; log-sum-exp in fp32
    # gated MLP: gate and up outputs, the activation, and their product (down_proj's input)
    if arch.experts:
        mlp = arch.experts_per_token * 4 * inter * c + arch.experts * c
    else:
        mlp = 4 * inter * c
    if s.dora:
        # DoRA keeps each target's base output twice (scaled and unscaled) beside the LoRA path
        mlp += 2 * (q + 2 * kv + 2 * h + 2 * inter) * c
    return norms + inputs, attention + mlp


def dora_transient_bytes(arch, s: Setup) -> float:
    """peft's DoRA builds each adapter's weight as B(A(I)) with an in x in identity every forward
    (its graph is dropped at once); the widest input, down_proj's, sets the spike."""
    if not s.dora:
        return 0.0
    return max(arch.hidden, arch.intermediate) ** 2 * 4


def block_cast_bytes(counts, arch, s: Setup) -> float:
    """Half-precision weight copies autocast makes in one block and its Linears keep for backward."""
    if weight_mode(s) != "autocast":
        return 0.0
    # only the fp32 adapters are cast under LoRA; the frozen base is already half precision
    weights = counts.lora if s.adapter else counts.block_linear
    return weights / max(arch.layers, 1) / (s.tp * s.pp) * COMPUTE[s.precision]


def cast_bytes(counts, arch, s: Setup) -> float:
    """Autocast's weight copies alive at the start of backward: every block's (one block's under
    recomputation) and, in full fine-tuning, the output head's."""
    per_block = block_cast_bytes(counts, arch, s)
    if not per_block:
        return 0.0
    blocks = per_block * (arch.layers if s.checkpointing == "none" else 1)
    head = arch.vocab * arch.hidden / s.tp * COMPUTE[s.precision] if not s.adapter else 0.0
    return blocks + head
