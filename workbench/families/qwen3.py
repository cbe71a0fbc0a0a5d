"""Qwen3: q and k RMS-normalised per head (Megatron's qk_layernorm), Qwen2's split rule."""

from workbench.families.spec import FamilySpec, Gguf, Megatron

SPEC = FamilySpec(
    model_type="qwen3", config_class="Qwen3Config",
    gguf=Gguf(arch="qwen3", pre_tokenizer="qwen2"),
    qk_norm=True, megatron=Megatron(),
)
