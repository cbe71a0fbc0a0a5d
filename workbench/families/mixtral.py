"""Mixtral: a sparse mixture of experts (Megatron-Core MoE layers, top-k softmax router); no
GGUF export here (llama.cpp's converter merges the experts, which the writer does not)."""

from workbench.families.spec import FamilySpec, Megatron

SPEC = FamilySpec(model_type="mixtral", config_class="MixtralConfig", experts=True, megatron=Megatron())
