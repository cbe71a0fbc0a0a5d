"""The shape of workbench/ held as code: few top-level modules, import layers that only point
down, and no import cycle, counting imports inside functions and the packages whose
`__init__` an import runs.

    python -m pytest -q tests/unit/test_layout.py

The graph is read from the source (ast), not from a running interpreter, so an import that only
runs on a GPU or under one launcher counts too. Plugin loads by name (importlib) are refused
outright: a module that needs another imports it, and the registries
(workbench/methods/registry.py, workbench/backends/registry.py) list the choices.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

PKG = ROOT / "workbench"
MODULES = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
           for p in sorted(PKG.rglob("*.py"))}

# Import layers, lowest first (README, "Layout"): a module imports only from its own layer or
# lower ones. Entries are module prefixes; the longest matching prefix places a module.
LAYERS = [
    # foundation: nothing from the workbench but itself
    ["workbench.core", "workbench.config.schema", "workbench.config.files", "workbench.train.batch",
     "workbench.train.state", "workbench.train.distributed", "workbench.train.signal", "workbench.train.noise"],
    # parts: tensors, data, models, the arithmetic of precision and FLOPs
    ["workbench.train.precision", "workbench.train.optim", "workbench.train.kernels", "workbench.data",
     "workbench.models", "workbench.peft", "workbench.megatron", "workbench.rollout", "workbench.envs",
     "workbench.telemetry.flops", "workbench.export.gguf"],
    # engines: methods, backends, evaluations, checkpoints, what observes a run, the planner
    ["workbench.methods", "workbench.backends", "workbench.evals", "workbench.train.checkpoint",
     "workbench.train.canonical", "workbench.train.resume", "workbench.train.replay", "workbench.train.faults",
     "workbench.train.keep_best", "workbench.train.watchdog", "workbench.telemetry", "workbench.plan",
     "workbench.export.parity", "workbench.export.hub"],
    # the resolved run: validation, the rule table and the decisions derived from a config
    ["workbench.config.validate", "workbench.config.run", "workbench.config.rules", "workbench.config.resolved",
     "workbench.plan.make"],
    # products: preflight, the export, the report
    ["workbench.config.preflight", "workbench.export", "workbench.telemetry.report"],
    # the loop
    ["workbench.train.runner"],
    # entry points
    ["workbench.cli", "workbench.__main__", "workbench.report", "workbench.launch", "workbench.export.__main__"],
]
UNLAYERED = {"workbench", "workbench.config", "workbench.train", "workbench.telemetry", "workbench.export",
             "workbench.plan"}  # package docstrings, nothing imported


def layer(module: str) -> int:
    best, where = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, where = len(p), i
    assert where is not None, f"{module}: in no layer of LAYERS (add it there and to the README's Layout)"
    return where


def _target(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports() -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported module, line)], every import statement, at any depth, plus the
    `__init__` of each package on the way to it (Python runs those first)."""
    out: dict[str, list[tuple[str, int]]] = {}
    for name, path in MODULES.items():
        found = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                         for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for full in names:
                target = _target(full) if full.startswith("workbench") else None
                if target is None or target == name:
                    continue
                parts = target.split(".")
                for k in range(2, len(parts) + 1):  # a.b's __init__, then a.b.c ...
                    step = ".".join(parts[:k])
                    if step in MODULES and not name.startswith(step + ".") and step != name:
                        found.append((step, node.lineno))
        out[name] = found
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 8, top


def test_no_import_cycle_lazy_imports_and_package_inits_included():
    graph = {m: {t for t, _ in edges} for m, edges in imports().items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_cycle():
    # the check above is only as good as this: a cycle closed by an import inside a function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_loaded_by_name():
    by_name = re.compile(r"import_module\(\s*f?[\"']workbench|__import__\(\s*f?[\"']workbench")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in MODULES.values()
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_name.search(line)]
    assert found == []


def test_no_import_runs_upward():
    upward = [f"{m} ({layer(m)}) imports {t} ({layer(t)}) at line {line}"
              for m, edges in imports().items() if m not in UNLAYERED
              for t, line in edges if t not in UNLAYERED and layer(t) > layer(m)]
    assert upward == []


def test_package_inits_import_nothing():
    # importing a.b.c runs a/b/__init__: packages stay docstrings so that costs nothing
    heavy = [m for m in UNLAYERED | {"workbench.methods", "workbench.backends", "workbench.core", "workbench.data"}
             if m in MODULES and any(isinstance(n, (ast.Import, ast.ImportFrom)) and not
                                     (isinstance(n, ast.ImportFrom) and n.module == "__future__")
                                     for n in ast.walk(ast.parse(MODULES[m].read_text())))]
    assert heavy == []


def test_readme_layout_names_every_package_and_top_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    tops = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    missing = [n for n in packages + tops if not re.search(rf"\b{re.escape(n)}\b", layout)]
    assert missing == []
