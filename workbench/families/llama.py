"""Llama (and SmolLM2, which is a Llama): rotary Q/K rows permuted for llama.cpp, byte-level BPE
written with llama-bpe's split rule, Megatron mapped as the plain GPT layer."""

from workbench.families.spec import FamilySpec, Gguf, Megatron

SPEC = FamilySpec(
    model_type="llama", config_class="LlamaConfig",
    gguf=Gguf(arch="llama", permute_qk=True, pre_tokenizer="llama-bpe"),
    megatron=Megatron(),
)
