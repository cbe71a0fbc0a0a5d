"""What a model family is, as every path reads it: building a config from conf/model numbers
(workbench/models/load.py), rebuilding a tokenizer from a GGUF (workbench/models/gguf_tokenizer.py),
the GGUF export and its read-back (workbench/export/gguf.py, write.py), the Megatron bridge
(workbench/megatron/model.py, bridge.py) and the rules that refuse what a family cannot do
(workbench/resolve/rules.py, workbench/backends/megatron.py).

    from workbench.families import registry
    spec = registry.get("gemma3_text")          # None: a model type no module describes
    spec.gguf.arch, spec.megatron is None        # "gemma3", True: no Megatron mapping

A new family is one module in this folder with a `SPEC` and one line in registry.py
(docs/guides/extending.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gguf:
    """How the family is written as GGUF (llama.cpp's conversion rules the `gguf` package leaves out)."""

    arch: str  # general.architecture
    permute_qk: bool = False  # Q/K rows reordered for llama.cpp's rotary layout (Llama-family weights)
    norm_plus_one: bool = False  # RMSNorm scales by 1 + w (Gemma): the file stores 1 + w
    pre_tokenizer: str = "default"  # tokenizer.ggml.pre for a byte-level BPE vocabulary
    sliding_window: bool = False  # the file carries the local layers' window
    # GGUF readers scale attention by 1/sqrt(head_dim); the family's config may say otherwise
    # (query_pre_attn_scalar), which the export refuses
    query_scale_from_head_dim: bool = False
    # the model type transformers' GGUF reader must be handed to read the file back (mistral is
    # written as llama); None: its own
    read_back_as: str | None = None


@dataclass(frozen=True)
class Megatron:
    """How the family maps onto Megatron-Core's GPTModel (workbench/megatron/model.py)."""

    qkv_bias: bool = False  # q/k/v projections carry biases (Qwen2)


@dataclass(frozen=True)
class FamilySpec:
    model_type: str  # transformers' model_type, as conf/model/*.yaml's arch.family names it
    # other names the family's vocabulary and template go by: model types of the same tokenizer
    # (gemma, gemma2) and the GGUF architecture a file says
    aliases: tuple[str, ...] = ()
    config_class: str | None = None  # transformers config class; None: AutoConfig.for_model(model_type)
    # a sparse mixture of experts whose config takes model.arch's experts as num_local_experts and
    # num_experts_per_tok (Mixtral; Megatron maps it onto its MoE layers)
    experts: bool = False
    # What a decoder block keeps for backward beyond a Llama block's (workbench/plan/activations.py),
    # and how Megatron-Core builds it (qk_layernorm):
    qk_norm: bool = False  # q and k RMS-normalised per head (Qwen3, Gemma 3)
    norms_per_block: int = 2  # RMSNorms in a block (Gemma 3: 4, before and after attention and the MLP)
    norm_in_fp32: bool = False  # the norm scales in fp32 (Gemma's 1 + w): a trainable scale keeps an fp32 copy
    gguf: Gguf | None = None  # None: no GGUF export (convert with llama.cpp's own script)
    megatron: Megatron | None = None  # None: backend=megatron refuses the family
    # a SentencePiece vocabulary rebuilt from a GGUF: transformers' tokenizer class (its conversion
    # rules) and the chat template the family uses where the file has none
    tokenizer_class: str = "LlamaTokenizer"
    chat_template: str | None = None
    template_name: str | None = None  # data.chat_template=<name> picks chat_template for any model
