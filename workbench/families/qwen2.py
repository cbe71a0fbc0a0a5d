"""Qwen2: biases on q/k/v (Megatron's add_qkv_bias), byte-level BPE with Qwen's split rule."""

from workbench.families.spec import FamilySpec, Gguf, Megatron

SPEC = FamilySpec(
    model_type="qwen2", config_class="Qwen2Config",
    gguf=Gguf(arch="qwen2", pre_tokenizer="qwen2"),
    megatron=Megatron(qkv_bias=True),
)
