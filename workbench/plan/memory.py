"""Per-device memory of a training step, term by term.

    weights      trainable and frozen parameters (NF4 blocks with their quantisation constants);
                 under FSDP2 / ZeRO-3 the local shard plus the gathered root unit and two blocks;
                 under Megatron also the whole HF model where the run keeps it beside the
                 GPTModel shards (run.keeps_hf_base; Estimate.hf_copy says how much)
    master       fp32 master weights where the backend keeps bf16 params (DeepSpeed, Megatron)
    grads        gradients of trainable parameters
    optimizer    AdamW moments (2 per trainable parameter)
    activations  what autograd saves per token per block (workbench.plan.activations, counted
                 tensor by tensor from the HF Llama/Mixtral blocks for each precision, peft and
                 attention kernel) x tokens
    casts        autocast's half-precision copies of fp32 weights, kept for backward (bf16-mixed
                 and fp16 on one device; sharded and DeepSpeed/Megatron runs hold half params)
    logits       log-softmax, its gradient and the logits' gradient at the selected positions
    transient    the dense embedding gradient made in backward; the two temporaries of
                 torch's AdamW step (all parameters with foreach on GPU, the largest tensor on CPU)
    reference    DPO/KTO/GRPO-with-KL: a frozen reference copy (ref=copy); none for adapter-disabled
                 or precomputed; distillation: the frozen teacher
    generation   methods that generate: KV cache (prompt + completion) and the vocabulary-wide
                 tensors of a decode step (HF generate) for every completion the rank decodes
                 at once (GRPO: its whole rollout, prompts x num_generations)

A GRPO micro-batch is its completions, side by side after their prompt in one row per prompt
(method.share_prompt) or a row each; only the completions' tokens carry a loss.

Peak = weights + master + optimizer + the largest of
  backward:  max(activations + casts + logits + head gradient + earlier micro-batches' gradients,
                 gradients + dense embedding gradient)
  step:      gradients + optimizer temporaries
  rollout:   generation (a method that generates before it trains: the KV cache is freed before
             the activations exist; the traced GRPO step, docs/measurements/trace-matrix.md)
plus reference, and generation on top where the rollout runs beside the step (async); "transient"
reports what the peak holds beyond the listed terms.
The earlier micro-batches' gradients (train.grad_accum > 1) are the gradients as the backend keeps
them, or whole on every rank where a sharding backend skips their sync until the last one.
Sharding divides each term by the backend: ZeRO-1 optimizer (+master), ZeRO-2 also grads, ZeRO-3 /
FSDP2 also weights; offload moves optimizer (and params) to host memory; tensor/pipeline/context/expert parallel sizes split
blocks, sequence and experts. `tests/integration/test_plan_memory.py` holds the predicted
peak against the torch allocator's measured peak on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.backends.spec import syncs_each_micro_batch
from workbench.compute.precision import POLICIES
from workbench.methods import registry
from workbench.plan.activations import (
    COMPUTE,
    block_parts,
    cast_bytes,
    dora_transient_bytes,
    residual_bytes,
    weight_mode,
)
from workbench.plan.counts import Counts
from workbench.plan.setup import Setup

# bytes per element by precision name, from the policies themselves (workbench/compute/precision.py)
TRAINABLE = {name: pol.bytes("trainable") for name, pol in POLICIES.items()}
FROZEN = {name: pol.bytes("frozen") for name, pol in POLICIES.items()}
# bitsandbytes NF4, blocksize 64: 4 bits per weight + one absmax per block; double
# quantisation stores the absmax as 8-bit with an fp32 constant per 256 blocks.
NF4_BLOCK = 64
# fp32 vocabulary-wide tensors per generated row at a decode step: the logits, the warped scores,
# the Gumbel uniforms and the one-hot scores (workbench/rollout/generate.py gumbel_max)
LOGIT_COPIES = 4


def nf4_bytes_per_param(double_quant: bool) -> float:
    if double_quant:
        return 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * 256)
    return 0.5 + 4 / NF4_BLOCK


@dataclass(frozen=True)
class Estimate:
    weights: float
    master: float
    grads: float
    optimizer: float
    activations: float
    casts: float
    logits: float
    transient: float
    reference: float
    generation: float
    host: float  # offloaded to CPU memory
    peak: float
    vllm_fraction: float = 0.0  # share of device memory a colocated vLLM engine reserves
    hf_copy: float = 0.0  # of `weights`: the whole HF model a bridging backend keeps beside its own shards

    def terms(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("weights", "master", "grads", "optimizer", "activations",
                                              "casts", "logits", "transient", "reference", "generation")}


def tokens_per_micro(s: Setup) -> int:
    if s.rollouts:  # GRPO: completions of one prompt side by side in a row, or a row each
        return rollout_rows(s) * seq_len(s)
    seqs = s.micro_batch * registry.spec(s.method).facts.sequences  # e.g. DPO: chosen and rejected
    return seqs * seq_len(s)


def branches(s: Setup) -> int:
    """Completions per training row: a micro-batch's completions of one prompt share a row
    under share_prompt (workbench/data/pair_tree.py branch_batch), else one each."""
    return max(1, min(s.micro_batch, s.generations)) if s.rollouts and s.share_prompt else 1


def rollout_rows(s: Setup) -> int:
    return -(-s.micro_batch // branches(s))


def seq_len(s: Setup) -> int:
    """Positions per row: the prompt (data.seq_len) and what is generated after it."""
    if registry.spec(s.method).facts.generates:
        return s.seq_len + branches(s) * s.completion_len
    return s.seq_len


def selected_per_micro(s: Setup) -> float:
    """Positions with a loss in a micro-batch: the completions' tokens for a method that trains
    on rollouts, else plan.select_fraction of every position."""
    if s.rollouts:
        return float(s.micro_batch * s.completion_len)
    return tokens_per_micro(s) * s.select_fraction


def activation_bytes(arch, s: Setup, tokens: int | None = None, seq: int | None = None) -> float:
    """Saved activations of one micro-batch: `tokens` in all, padded to `seq` per sequence."""
    tokens = tokens_per_micro(s) if tokens is None else tokens
    replicated, sharded = block_parts(arch, s, seq_len(s) if seq is None else seq)
    # tensor parallelism shards attention and the MLP; what it replicates it splits by tokens only
    # under sequence parallelism (Megatron-Core's sequence_parallel), else every TP rank holds it
    tp_tokens = s.tp if s.tp_splits_tokens else 1
    per_block = replicated / tp_tokens + sharded / s.tp
    split = s.cp * s.sp  # context parallel and backend.sp split every token
    kept = arch.hidden * residual_bytes(s) / tp_tokens  # a checkpointed block keeps only its input
    if s.checkpointing == "full":
        total = tokens * (arch.layers * kept + per_block)  # one block recomputed at a time
    elif s.checkpointing == "selective":
        ck = arch.layers // max(s.checkpoint_every, 1)
        total = tokens * (ck * kept + (arch.layers - ck) * per_block + per_block)
    else:
        total = tokens * arch.layers * per_block
    total += tokens * 3 * arch.hidden * residual_bytes(s) / tp_tokens  # embedding output, final norm
    seq = seq_len(s) if seq is None else seq
    return total / split + sp_attention_bytes(arch, s, tokens, seq) + dora_transient_bytes(arch, s)


def sp_attention_bytes(arch, s: Setup, tokens: float, seq: int) -> float:
    """What attention holds beyond the per-token block terms: the mask of packed rows, and under
    backend.sp the key/value heads repeated to one per query head where they cannot be split with
    them (workbench/train/sequence_parallel.py).

    A packed row attends through a (seq x seq) boolean mask, and SDPA keeps it for its backward
    converted to the compute dtype, once per decoder block (PyTorch's CPU flash kernel; one block
    at a time under full checkpointing). Under backend.sp the mask covers the whole row on every
    rank: it is not divided by sp."""
    blocks = 1 if s.checkpointing == "full" else arch.layers
    rows = tokens / max(seq, 1)
    mask = rows * seq * seq * (1 + blocks * COMPUTE[s.precision]) if s.packed else 0.0
    if s.sp <= 1:
        return mask
    heads, kv = arch.heads, arch.kv_heads or arch.heads
    d = arch.head_dim or arch.hidden // heads
    repeated = 0.0
    if kv != heads and (kv % s.sp or heads % s.sp):
        repeated = blocks * tokens / s.sp * 2 * (heads - kv) * d * COMPUTE[s.precision]
    return mask + repeated


def logits_bytes(arch, s: Setup, selected: float | None = None) -> float:
    if selected is None:
        selected = selected_per_micro(s)
    # The loss upcasts: at the log-softmax backward its fp32 output, the incoming gradient and the
    # outgoing one are alive (3 x 4 bytes); the half-precision logits were freed after forward.
    # A backend that gathers the selected logits over TP for the method's own log-softmax
    # (Megatron: workbench/megatron/lm.py) holds them whole, except distillation's, which stays
    # vocabulary-parallel.
    split = 1 if s.facts.gathers_logits and not registry.spec(s.method).facts.teacher else s.tp
    selected = selected / s.sp  # backend.sp: each rank scores its slice of the rows
    if s.loss_chunk and not s.facts.head_every_position:
        # model.loss_chunk: one checkpointed piece's logits at a time (workbench/models/head.py)
        selected = min(selected, s.loss_chunk)
    return selected * arch.vocab * 12 / split


def estimate(counts: Counts, arch, s: Setup, tokens: int | None = None, selected: float | None = None,
             seq: int | None = None) -> Estimate:
    """Bytes per device for this setup; `tokens`/`selected`/`seq` override the config's batch shape."""
    mp = s.tp * s.pp
    dp = s.dp
    f = s.facts  # what the backend holds (workbench/backends/spec.py)
    distopt = s.distributed_optimizer
    # half-precision parameters with fp32 master weights: DeepSpeed, and Megatron-Core's own
    # optimizer (backend=megatron with a torch optimizer trains the policy's trainable dtype)
    half_params = (f.master_weights or distopt) and s.precision != "fp32"
    # parameters held per device before data-parallel sharding
    expert = counts.total - counts.active if counts.active < counts.total else 0
    per_dev = (counts.total - counts.embed - expert) / mp + counts.embed / s.tp + expert / (mp * s.ep)
    if not s.adapter:
        trainable, frozen_bytes = per_dev, 0.0
        w_bytes = (2 if half_params else TRAINABLE[s.precision]) * trainable
    else:
        # a model-parallel backend's own LoRA layers (Megatron's, workbench/megatron/lora.py) split
        # column projections' B and row projections' A over TP, and replicate the other halves
        trainable = (counts.lora - counts.lora_split) / s.pp + counts.lora_split / mp if f.model_parallel \
            else counts.lora / mp
        base = per_dev
        quant = counts.block_linear / mp if s.quantised else 0.0
        frozen_bytes = (base - quant) * FROZEN[s.precision] + quant * nf4_bytes_per_param(s.double_quant)
        w_bytes = frozen_bytes + trainable * 4  # adapters train in fp32
    if distopt:
        g_per = 4  # DDP's gradient buffer, reduced in fp32 (grad_reduce_in_fp32)
    else:
        g_per = 2 if (half_params and not s.adapter) else 4 if s.adapter else TRAINABLE[s.precision]
    state_per = 4 if (half_params or s.adapter) else TRAINABLE[s.precision]
    moments = 2 if s.optimizer == "adamw" else 0
    grads = trainable * g_per
    optim = trainable * moments * state_per
    master = trainable * 4 if (half_params and not s.adapter) else 0.0
    weights = w_bytes
    stage = s.zero_stage  # the distributed optimizer shards main weights and moments: 1
    if distopt and not s.adapter and expert and s.ep > 1:
        # expert state is sharded over the expert-data-parallel ranks (dp / ep of them), not dp
        e_dev = expert / (mp * s.ep)
        e_share = e_dev / trainable
        optim = optim * (1 - e_share) / dp + optim * e_share / max(1, dp // s.ep)
        master = master * (1 - e_share) / dp + master * e_share / max(1, dp // s.ep)
    elif stage >= 1:
        optim, master = optim / dp, master / dp
    if stage >= 2:
        grads = grads / dp
    if stage >= 3:
        weights = weights / dp
    host = 0.0
    if s.offload_optimizer:
        host += optim + master
        optim = master = 0.0
    if s.offload_params and stage >= 3:
        host += weights
        weights = 0.0
    # FSDP2 / ZeRO-3 compute a unit with a full copy of its parameters beside the local shard:
    # the root unit (embeddings, head), plus a block and its prefetch. FSDP2 all-gathers into
    # a buffer and copies out, so while a unit is gathered a second full copy exists briefly.
    gather = root = 0.0
    fsdp_regather = stage >= 3 and dp > 1 and f.regathers_root
    if stage >= 3 and dp > 1:
        # gathered in the compute dtype where the backend keeps half-precision params (FSDP2's
        # MixedPrecisionPolicy included)
        unit_bytes = (COMPUTE[s.precision] if weight_mode(s) == "half" else TRAINABLE[s.precision]) \
            if not s.adapter else FROZEN[s.precision]
        root = counts.embed / s.tp * unit_bytes
        gather = root + 2 * counts.per_block / mp * unit_bytes
    # A sharding backend that skips the gradient sync before the last micro-batch (its option,
    # workbench/backends/spec.py syncs_each_micro_batch) leaves each rank the unsharded gradients
    # of the micro-batches so far, in the reduce dtype (fp32: backend.reduce_dtype's default; FSDP2
    # casts them to it as it accumulates), through every later micro-batch's forward and backward.
    held = 0.0
    if stage >= 2 and dp > 1 and s.grad_accum > 1 and f.accumulation_sync_field:
        share = counts.lora if s.adapter else counts.total
        if not syncs_each_micro_batch(s.accum_sync, share, counts.total):
            held = trainable * 4
    # Every micro-batch after a step's first runs its forward and backward beside the gradients
    # accumulated so far: the held unsharded ones above, else the gradients as the backend keeps
    # them (sharded from ZeRO-2 / FSDP2 on, reduce-scattered after each micro-batch).
    prior = held or (grads if s.grad_accum > 1 else 0.0)
    acts = activation_bytes(arch, s, tokens, seq)
    casts = cast_bytes(counts, arch, s)  # freed, like the activations, by the backward that uses them
    logit = logits_bytes(arch, s, selected)
    if f.head_every_position:
        # GPTModel's output layer computes the logits of every position (this rank's vocabulary
        # columns) in the compute dtype and copies them once as it transposes them to [b, s];
        # the loss's selected logits come after the two are gone
        every = (tokens if tokens is not None else tokens_per_micro(s)) * arch.vocab / s.tp
        # where the logits are gathered over TP for the loss, the loss's backward also hands back
        # their gradient in the compute dtype before it is split over TP again (the traced step at
        # 8B TP 8: 0.5 GiB, docs/measurements/trace-matrix.md)
        gathers = f.gathers_logits and not registry.spec(s.method).facts.teacher  # as logits_bytes
        gathered_grad = logit * COMPUTE[s.precision] / 12 if gathers else 0.0
        logit = max(logit + gathered_grad, 2 * every * COMPUTE[s.precision])
    embed_grad = arch.vocab * arch.hidden * g_per / s.tp if not s.adapter else 0.0
    if distopt and not s.adapter:  # autograd's gradient, in the parameters' dtype, before DDP adds it to its buffer
        embed_grad = arch.vocab * arch.hidden * (2 if half_params else 4) / s.tp
    opt_tmp = _optimizer_temporaries(arch, s, trainable, dp, stage, moments * state_per)
    # backend=megatron bridges the runner's HF model into its GPTModel shards; the HF model stays
    # whole on every device when something reads it between steps (run.keeps_hf_base)
    hf_copy = 0.0
    if f.bridges_hf_model and s.hf_copy:
        hf_copy = counts.total * (TRAINABLE[s.precision] if not s.adapter else FROZEN[s.precision])
    weights += hf_copy
    if f.bridges_hf_model and s.adapter:  # the HF model's adapters (fp32), bridged back after steps
        if s.hf_copy or s.device == "cpu":
            weights += counts.lora * 4
        else:
            host += counts.lora * 4  # loaded on the host when its base is released (run.model_device)
    reference = _other_models(counts, s, per_dev, dp, stage)
    generation, vllm = _generation(arch, s, mp)
    # Backward runs from the head down: at its start all activations (and the head's gradient)
    # are alive, by its end the activations are freed and all gradients (plus the dense
    # embedding gradient) exist; the optimizer step then holds gradients, state and temporaries.
    head_grad = embed_grad
    if fsdp_regather:
        # FSDP2 reshards the root after forward and gathers it again for the head's backward,
        # when of the logits only their gradient is left: then the all-gather buffer and its
        # copy-out are both alive. Once the gather is done, with a trainable embedding the head's
        # dense gradient, the embedding's and (tied) their sum exist at once, unsharded until the
        # reduce-scatter; those are in the compute dtype under a MixedPrecisionPolicy. The root's
        # reduce-scatter comes last, when every sharded gradient exists and the root is resharded:
        # it holds two full fp32 (reduce dtype) copies of the embedding gradient.
        unsharded = arch.vocab * arch.hidden / s.tp
        dense = unsharded * COMPUTE[s.precision] if embed_grad and weight_mode(s) == "half" else embed_grad
        reduce = grads + 2 * unsharded * 4 - root if embed_grad else 0.0
        # Before that, the loss's log-softmax backward holds its fp32 output and both gradients
        # (`logit`, 12 bytes per element) beside the activations: the larger moment where the
        # logits outweigh the root (DPO's two rows of a 128k vocabulary; the traced step, 4.1 GiB
        # of temporaries at 8B, docs/measurements/trace-matrix.md). Only the logits' gradient,
        # cast to the compute dtype, is left when the root is gathered (the CPU allocator's peak
        # on two real ranks, tests/integration/test_plan_memory.py).
        logit_grad = logit * COMPUTE[s.precision] / 12
        moment = max(acts + logit + prior, acts + logit_grad + root + prior,
                     (3 if arch.tie_embeddings else 2) * dense + prior, reduce)
    else:
        moment = max(acts + casts + logit + head_grad + prior, grads + embed_grad)
    if distopt:  # Megatron-Core's DDP keeps its gradient buffer allocated for the whole run
        moment = max(acts + casts + logit + head_grad, embed_grad) + grads
    backward = weights + gather + master + optim + moment
    step = weights + master + optim + grads + opt_tmp
    if s.rollout_overlaps:  # an async rollout generates beside the step's training
        peak = max(backward, step) + reference + generation
    else:  # the rollout generates before the step trains: its KV cache goes before the activations come
        rollout = weights + gather + master + optim + generation
        peak = max(backward, step, rollout) + reference
    grads = max(grads, held)  # reported as held at the peak: unsharded until the last micro-batch
    transient = max(0.0, peak - (weights + master + optim + grads + acts + casts + logit + reference
                                 + (generation if s.rollout_overlaps else 0.0)))
    weights += gather  # reported with the weights: gathered copies are weights on this device
    transient = max(0.0, transient - gather)
    return Estimate(weights=weights, master=master, grads=grads, optimizer=optim, activations=acts, casts=casts,
                    logits=logit, transient=transient, reference=reference, generation=generation, host=host,
                    peak=peak, vllm_fraction=vllm, hf_copy=hf_copy)


def _optimizer_temporaries(arch, s: Setup, trainable: float, dp: int, stage: int, state_bytes: float) -> float:
    """The optimizer step's temporaries. torch's AdamW makes two parameter-sized ones: for the
    whole list at once with the foreach kernels (GPU default), for one tensor at a time on CPU;
    DeepSpeed and Megatron fuse. `state_bytes`: the moments' bytes per trainable parameter."""
    if s.device == "cpu":
        biggest = max(arch.vocab * arch.hidden, arch.hidden * arch.intermediate) / s.tp if not s.adapter \
            else 16 * max(arch.hidden, arch.intermediate)
        span = min(biggest, trainable)
    else:
        span = trainable / (dp if stage >= 1 else 1)
    distopt = s.distributed_optimizer
    # Megatron-Core's optimizer steps with Transformer Engine's or Apex's fused Adam on a GPU, and
    # torch's AdamW (one tensor at a time) on this rank's shards on a CPU.
    fused = s.facts.fused_optimizer or (distopt and s.device != "cpu")
    if distopt and s.device == "cpu":
        span = span / dp
    return 0.0 if fused or s.offload_optimizer or not state_bytes else span * state_bytes


def _other_models(counts: Counts, s: Setup, per_dev: float, dp: int, stage: int) -> float:
    """A copied reference model (the method's loss needs one: resolved.reference says "copy")
    and a distillation teacher. Megatron's reference and teacher are HF models, whole."""
    f = s.facts
    whole = counts.total if f.bridges_hf_model else per_dev
    out = 0.0
    if s.dpo_ref == "copy":
        ref_bytes = TRAINABLE[s.precision] if f.bridges_hf_model and not s.adapter else FROZEN[s.precision]
        out = whole * ref_bytes / (dp if stage >= 3 else 1)
    if registry.spec(s.method).facts.teacher:
        # a frozen teacher held whole on every device, in the frozen dtype; sized like the student
        # unless plan.teacher_scale says how many times larger it is
        out += whole * s.teacher_scale * FROZEN[s.precision]
    return out


def _generation(arch, s: Setup, mp: int) -> tuple[float, float]:
    """(bytes, vLLM's share of device memory) of generating during training: the KV cache and
    the sampler's logits with HF generate, or the share a colocated vLLM engine reserves."""
    if not registry.spec(s.method).facts.generates:
        return 0.0, 0.0
    if s.vllm_fraction:
        return 0.0, s.vllm_fraction
    d = arch.head_dim or arch.hidden // arch.heads
    # a rollout decodes all of this rank's completions at once; other generating methods
    # (on-policy distillation) a micro-batch
    seqs = s.rollout_prompts * s.generations if s.rollouts else max(s.micro_batch, s.generations)
    kv = 2 * arch.layers * arch.kv_heads * d * COMPUTE[s.precision] * seqs * (s.seq_len + s.completion_len)
    # the step's logits in fp32, the sampler's noise and its one-hot scores beside them
    return kv / mp + LOGIT_COPIES * seqs * arch.vocab * 4, 0.0
