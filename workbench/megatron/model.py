"""A Megatron-Core GPTModel built from a Hugging Face config (Llama, Qwen2, Qwen3, Mixtral).

    from workbench.megatron.model import Parallel, check_parallel, build_gpt
    par = Parallel(tp=2, pp=1)
    check_parallel(hf_config, par, world_size=2)        # UserError if sizes do not divide
    gpt = build_gpt(hf_config, par, torch.float32)      # this rank's TP shard / PP stage

What maps to what: RMSNorm -> normalization="RMSNorm"; SwiGLU -> gated_linear_unit + silu;
RoPE (default or llama3 scaling) -> position_embedding_type="rope"; GQA -> num_query_groups;
Qwen2's q/k/v biases -> add_qkv_bias; Qwen3's q/k RMSNorm -> qk_layernorm; Mixtral's sparse
MoE -> Megatron-Core MoE layers (SequentialMLP experts, top-k softmax router, no aux loss,
as Mixtral's HF forward computes). The layer spec is Megatron-Core's local (non-TE) spec with
the attention core of attention.py (torch SDPA, on every device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.core.errors import UserError, missing_package
from workbench.families import registry as families
from workbench.families.spec import Megatron
from workbench.megatron.attention import sdp_attention
from workbench.megatron.cpu_shim import cpu_device, patch_cpu_autocast, patch_missing_te


@dataclass(frozen=True)
class Parallel:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full


def require_megatron():
    """Import megatron.core or raise the install hint."""
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        raise missing_package("megatron-core", "megatron") from None


def family(hf_config) -> str:
    """The model type, if its family has a Megatron mapping (workbench/families/); UserError if not."""
    name = getattr(hf_config, "model_type", None)
    spec = families.get(name)
    if spec is None or spec.megatron is None:
        arch = (getattr(hf_config, "architectures", None) or [name])[0]
        raise UserError(f"backend=megatron has no HF<->Megatron mapping for architecture {arch!r} "
                        f"(model_type={name!r}); mapped families: {families.megatron_model_types()}")
    return name


def mapping(hf_config) -> Megatron:
    """How the model's family maps onto Megatron-Core (its spec's `megatron`)."""
    return families.get(family(hf_config)).megatron


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def n_experts(hf_config) -> int | None:
    return getattr(hf_config, "num_local_experts", None) if families.get(family(hf_config)).experts else None


def check_parallel(hf_config, par: Parallel, world_size: int) -> None:
    """UserError naming the field when a parallel size does not divide what it splits."""
    family(hf_config)
    model_par = par.tp * par.pp * par.cp
    if world_size % model_par:
        raise UserError(f"backend.tp*pp*cp={par.tp}*{par.pp}*{par.cp}={model_par} does not divide the "
                        f"{world_size} processes (devices) of this run")
    splits = [("backend.tp", par.tp, "attention heads", hf_config.num_attention_heads),
              ("backend.tp", par.tp, "key/value heads", hf_config.num_key_value_heads),
              ("backend.tp", par.tp, "intermediate size", hf_config.intermediate_size),
              ("backend.pp", par.pp, "layers", hf_config.num_hidden_layers)]
    experts = n_experts(hf_config)
    if experts:
        splits.append(("backend.ep", par.ep, "experts", experts))
        if (world_size // (par.tp * par.pp)) % par.ep:
            raise UserError(f"backend.ep={par.ep} does not divide the data-parallel size "
                            f"{world_size // (par.tp * par.pp)}")
    elif par.ep != 1:
        raise UserError(f"backend.ep={par.ep} needs a mixture-of-experts model; {family(hf_config)} is dense")
    for field, size, what, n in splits:
        if size < 1 or n % size:
            raise UserError(f"{field}={size} does not divide the model's {n} {what}")


def rope(hf_config) -> dict:
    """Megatron's RoPE arguments from transformers' rope_parameters (v5) or rope_theta/rope_scaling."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return {"rotary_base": theta}
    if kind == "llama3":
        return {"rotary_base": theta, "rope_scaling": True, "rope_scaling_factor": params["factor"]}
    raise UserError(f"rope_type={kind!r} has no Megatron mapping here (default and llama3 are mapped)")


def padded_vocab(hf_config, tp: int) -> int:
    """Megatron splits the vocabulary over TP ranks; pad it to a multiple of tp (extra rows zero)."""
    v = hf_config.vocab_size
    return -(-v // tp) * tp


def transformer_config(hf_config, par: Parallel, dtype: torch.dtype, compute_dtype: torch.dtype | None = None):
    """Megatron's config for this model. `dtype`: the parameters'; `compute_dtype`: what the
    activations a pipeline stage sends are in (bf16 under bf16 autocast over fp32 parameters).
    The receiving stage allocates its buffer in `pipeline_dtype` and gloo copies bytes into it,
    so a bf16 activation received into an fp32 buffer is read as garbage (NaN losses)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = n_experts(hf_config)
    rules = mapping(hf_config)  # the family's Megatron mapping (workbench/families/)
    kw = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config), ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=rules.qkv_bias, qk_layernorm=families.get(family(hf_config)).qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fusions are CUDA kernels (apex / TE); the plain PyTorch paths give the same numbers.
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
        context_parallel_size=par.cp, expert_model_parallel_size=par.ep,
        sequence_parallel=par.sequence_parallel, params_dtype=dtype, pipeline_dtype=compute_dtype or dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        # The workbench divides summed losses by the global denominator itself.
        calculate_per_token_loss=True,
    )
    if experts:
        kw.update(num_moe_experts=experts, moe_router_topk=hf_config.num_experts_per_tok,
                  moe_ffn_hidden_size=hf_config.intermediate_size, moe_router_load_balancing_type="none",
                  moe_aux_loss_coeff=0.0, moe_grouped_gemm=False,
                  moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
                  moe_router_dtype="fp32")
    if par.recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif par.recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    return TransformerConfig(**kw)


def layer_spec(hf_config, config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec


    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = sdp_attention()
    return spec


def build_gpt(hf_config, par: Parallel, dtype: torch.dtype = torch.float32, scalar_head: bool = False,
              compute_dtype: torch.dtype | None = None):
    """This rank's GPTModel (its TP shard and PP stage), weights uninitialised (load via bridge).
    `scalar_head`: a reward model's one-output head in place of the vocabulary head (ScalarHead);
    `compute_dtype`: the precision policy's (transformer_config)."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel


    patch_missing_te()
    patch_cpu_autocast()
    config = transformer_config(hf_config, par, dtype, compute_dtype)
    with cpu_device():
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec(hf_config, config),
            vocab_size=padded_vocab(hf_config, par.tp), max_sequence_length=hf_config.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            parallel_output=True, share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
            position_embedding_type="rope", **rope(hf_config),
        )
    if scalar_head and model.post_process:
        model.output_layer = ScalarHead(hf_config.hidden_size, par.sequence_parallel)
    elif model.post_process:
        model.output_layer.register_forward_hook(_contiguous_grad_out, with_kwargs=True)
    mark_tp_shards(model)
    return model


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient made contiguous on its way back."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_grad_out(module, args, kwargs, out):
    """The vocabulary head's output gradient, made contiguous before the head's backward.
    GPTModel returns its [s, b, V/tp] logits transposed to [b, s, ...], so the gradient arrives as
    a transposed view; the backward of a frozen head (LoRA: Megatron-Core's
    LinearWithFrozenWeight) multiplies it by the weight with torch.matmul, which folds a view it
    cannot flatten into one mm only when the weight requires grad, and otherwise expands the
    weight to one copy per sequence position for a bmm, whose CPU kernel makes those copies
    contiguous: 192 MiB for the tiny model at 64 positions (tests/unit/test_trace.py, Megatron
    TP 2). One contiguous gradient costs the size of the logits' gradient instead. A trainable
    head folds the view by itself, and is left as it is (a tied head's weight is the embedding's,
    passed in the call)."""
    logits, bias = out
    weight = kwargs.get("weight")
    weight = getattr(module, "weight", None) if weight is None else weight
    if weight is None or weight.requires_grad or not torch.is_grad_enabled():
        return out
    return _ContiguousGrad.apply(logits), bias


class ScalarHead(torch.nn.Module):
    """A reward model's head on the last stage, in GPTModel's `output_layer` call signature:
    weight [1, hidden] replicated over TP (every TP rank computes the same score; no vocabulary
    to split or gather). Under sequence parallelism each rank scores its own tokens, the scores
    are all-gathered over the sequence and the weight's gradient, which then covers this
    rank's tokens, is summed over TP like the norms' (`sequence_parallel`)."""

    def __init__(self, hidden: int, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden))
        self.weight.tensor_model_parallel = False
        self.weight.sequence_parallel = sequence_parallel
        self.sp = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        out = torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype))  # [s(/tp), b, 1]
        if self.sp:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            out = gather_from_sequence_parallel_region(out, tensor_parallel_output_grad=False)
        return out, None


def mark_tp_shards(model) -> None:
    """Tag TP-sharded weights the way Megatron-Core's initialisers would.

    With perform_initialization=False (the bridge supplies the weights) Megatron-Core skips the
    initialiser that sets `tensor_model_parallel`; grad-norm and checkpoint code read it.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for mod in model.modules():
        dims = {ColumnParallelLinear: 0, VocabParallelEmbedding: 0, RowParallelLinear: 1}
        dim = next((d for cls, d in dims.items() if isinstance(mod, cls)), None)
        if dim is None:
            continue
        if getattr(mod, "weight", None) is not None and not hasattr(mod.weight, "partition_dim"):
            set_tensor_model_parallel_attributes(mod.weight, True, dim, 1)
        bias = getattr(mod, "bias", None)
        if dim == 0 and isinstance(bias, torch.nn.Parameter) and not hasattr(bias, "partition_dim"):
            set_tensor_model_parallel_attributes(bias, True, 0, 1)
