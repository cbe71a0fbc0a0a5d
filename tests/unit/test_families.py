"""A model family's facts live in its own module (workbench/families/<family>.py) and nowhere
else: no table keyed by family names, no comparison with one, outside workbench/families/.

    python -m pytest -q tests/unit/test_families.py
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT
from workbench.families import registry
from workbench.families.spec import FamilySpec

PKG = ROOT / "workbench"


def family_names() -> set[str]:
    """Every name a family goes by: model types, aliases, GGUF architectures."""
    names = set()
    for spec in registry.FAMILIES.values():
        names |= {spec.model_type, *spec.aliases}
        if spec.gguf:
            names.add(spec.gguf.arch)
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def family_tables(paths: list[Path], names: set[str]) -> list[str]:
    """Where a module outside workbench/families/ keys a dict by a family name, lists one in a
    set, tuple or list, or compares with one: a family fact kept outside its family's module."""
    found = []
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("workbench/families/"):
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        held = []  # the string constants in a table or a comparison
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                held += [k for k in node.keys if k is not None]
            elif isinstance(node, (ast.Set, ast.Tuple, ast.List)):
                held += node.elts
            elif isinstance(node, ast.Compare):
                held += [node.left, *node.comparators]
        for c in held:
            if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in names and id(c) not in skip:
                found.append(f"{rel}:{c.lineno} {c.value!r}")
    return sorted(set(found))


def test_no_family_table_outside_the_families_package():
    assert family_tables(sorted(PKG.rglob("*.py")), family_names()) == []


def test_the_finder_finds_each_form(tmp_path):
    planted = PKG / "export" / "_planted_for_the_test.py"
    try:
        planted.write_text('"""qwen2 in a docstring is prose."""\n'
                           'A = {"qwen2": 1}\n'
                           'B = ("llama", "x")\n'
                           'def f(t):\n    return t == "gemma3_text"\n'
                           'C = "qwen3"  # a name alone is not a table\n')
        found = family_tables([planted], family_names())
    finally:
        planted.unlink()
    rel = "workbench/export/_planted_for_the_test.py"
    assert found == [f"{rel}:2 'qwen2'", f"{rel}:3 'llama'", f"{rel}:5 'gemma3_text'"]


def test_every_family_module_is_registered_under_its_model_type():
    modules = {p.stem for p in (PKG / "families").glob("*.py")} - {"__init__", "spec", "registry"}
    assert {s.model_type for s in registry.FAMILIES.values()} and len(modules) == len(registry.FAMILIES)
    for model_type, spec in registry.FAMILIES.items():
        assert isinstance(spec, FamilySpec) and spec.model_type == model_type


@pytest.mark.parametrize("name, model_type", [("gemma3_text", "gemma3_text"), ("gemma3", "gemma3_text"),
                                              ("gemma2", "gemma3_text"), ("qwen3", "qwen3"), ("phi3", None)])
def test_a_gguf_architecture_or_alias_finds_its_family(name, model_type):
    spec = registry.by_any_name(name)
    assert (spec.model_type if spec else None) == model_type


def test_what_the_paths_read_comes_from_the_spec():
    # the writer's, the tokenizer rebuild's and the bridge's lists are the registry's
    assert registry.gguf_model_types() == ["gemma3_text", "llama", "mistral", "qwen2", "qwen3"]
    assert registry.megatron_model_types() == ["llama", "mixtral", "qwen2", "qwen3"]
    assert registry.get("gemma3_text").tokenizer_class == "GemmaTokenizer"
    assert registry.get("llama").gguf.permute_qk and not registry.get("qwen2").gguf.permute_qk
