"""The model families the workbench knows, by HF model type: the only list of them.

    spec = get("qwen3")                  # FamilySpec or None
    spec = by_any_name("gemma3")         # a model type, an alias or a GGUF architecture
    names = gguf_model_types()           # the model types the GGUF export writes
"""

from __future__ import annotations

from workbench.families import gemma3, llama, mistral, mixtral, qwen2, qwen3
from workbench.families.spec import FamilySpec

FAMILIES: dict[str, FamilySpec] = {m.SPEC.model_type: m.SPEC for m in (llama, mistral, qwen2, qwen3, mixtral, gemma3)}


def get(model_type: str | None) -> FamilySpec | None:
    return FAMILIES.get(model_type or "")


def by_any_name(name: str | None) -> FamilySpec | None:
    """The family whose model type, alias or GGUF architecture is `name` (a GGUF file names its
    architecture, not the model type); the model type wins over an alias."""
    if name in FAMILIES:
        return FAMILIES[name]
    return next((s for s in FAMILIES.values() if name in s.aliases or (s.gguf and s.gguf.arch == name)), None)


def gguf_model_types() -> list[str]:
    return sorted(t for t, s in FAMILIES.items() if s.gguf)


def megatron_model_types() -> list[str]:
    return sorted(t for t, s in FAMILIES.items() if s.megatron)
