"""Mistral: written to GGUF as llama (llama.cpp's converter does the same), which transformers'
GGUF reader then reads back only when told it is a llama; no Megatron mapping."""

from workbench.families.spec import FamilySpec, Gguf

SPEC = FamilySpec(
    model_type="mistral",
    gguf=Gguf(arch="llama", permute_qk=True, read_back_as="llama"),
)
