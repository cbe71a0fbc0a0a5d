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
# lower ones. A package is one layer: where a module sits is said by its package alone.
LAYERS = [
    # foundation: the batch, the state, the rank layout and process groups; nothing else imported
    ["workbench.core", "workbench.config", "workbench.train"],
    # parts: the arithmetic of a step, data, models and their families, adapters, rollouts
    ["workbench.compute", "workbench.families", "workbench.data", "workbench.models", "workbench.peft",
     "workbench.megatron", "workbench.rollout", "workbench.envs"],
    # engines: methods, backends, evaluation, checkpoints, the guard over a step
    ["workbench.methods", "workbench.backends", "workbench.evals", "workbench.checkpoints", "workbench.guard"],
    # the resolved run, its plan and what observes it
    ["workbench.resolve", "workbench.plan", "workbench.telemetry"],
    # products: the export
    ["workbench.export"],
    # the run: preflight, previews, the runner, the loop, the finish
    ["workbench.run"],
    # entry points
    ["workbench.cli", "workbench.__main__", "workbench.report", "workbench.launch", "workbench.serve"],
]
UNLAYERED = {"workbench"}  # the package's docstring, nothing imported


def layer(module: str) -> int:
    """The layer of a module's package (workbench.run.loop -> workbench.run); a top-level module
    (workbench.cli) is its own."""
    place = ".".join(module.split(".")[:2])
    where = [i for i, names in enumerate(LAYERS) if place in names]
    assert where, f"{module}: its package {place} is in no layer of LAYERS (add it there and to the README's Layout)"
    return where[0]


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


def package(module: str) -> str:
    """workbench.run.runner -> run; a top-level module (workbench.cli) is its own package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def two_way_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    edges = {(package(m), package(t)) for m, targets in graph.items() for t in targets if package(m) != package(t)}
    return sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})


def test_packages_form_layers_no_two_import_each_other():
    # a module cycle is refused above; this is the same rule one level up: if methods/ imports
    # train/, nothing in train/ imports methods/, lazily or not
    graph = {m: {t for t, _ in edges} for m, edges in imports().items()}
    assert two_way_pairs(graph) == []


def test_the_pair_finder_finds_a_two_way_pair():
    graph = {"workbench.a.x": {"workbench.b.y"}, "workbench.b.z": {"workbench.a.w"}, "workbench.c.q": {"workbench.a.x"}}
    assert two_way_pairs(graph) == [("a", "b")]


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
    inits = {m for m, path in MODULES.items() if path.name == "__init__.py"}
    heavy = [m for m in sorted(inits)
             if any(isinstance(n, (ast.Import, ast.ImportFrom)) and not
                    (isinstance(n, ast.ImportFrom) and n.module == "__future__")
                    for n in ast.walk(ast.parse(MODULES[m].read_text())))]
    assert heavy == []


def test_every_package_sits_in_one_layer():
    packages = {".".join(m.split(".")[:2]) for m in MODULES if m != "workbench"}
    listed = [p for names in LAYERS for p in names]
    assert sorted(packages - set(listed)) == [] and len(listed) == len(set(listed))


def test_readme_layout_names_every_package_and_top_module():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    tops = sorted(p.name for p in PKG.glob("*.py") if p.name != "__init__.py")
    missing = [n for n in packages + tops if not re.search(rf"\b{re.escape(n)}\b", layout)]
    assert missing == []


METHOD_NAMES = {"sft", "dpo", "kto", "cpo", "orpo", "rm", "grpo", "distill"}
BACKEND_NAMES = {"single", "fsdp2", "deepspeed", "megatron"}


def _strings(node: ast.AST) -> set[str]:
    """The string constants of a comparison's side: alone, or in a tuple, list or set."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {s for e in node.elts for s in _strings(e)}
    return set()


def name_comparisons(modules: dict | None = None) -> list[str]:
    """Where a module compares against a method's name outside workbench/methods/, or a backend's
    outside workbench/backends/ (`== "grpo"`, `in ("fsdp2", "deepspeed")`). A method's data shape
    (`facts.data == "sft"`) is a shape, not a method, and is left out."""
    found = []
    for path in (modules or MODULES).values():
        rel = path.relative_to(ROOT).as_posix()
        owned = (set() if rel.startswith("workbench/methods/") else METHOD_NAMES) | \
            (set() if rel.startswith("workbench/backends/") else BACKEND_NAMES)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "data" for s in sides):
                continue
            hits = sorted(set().union(*map(_strings, sides)) & owned)
            if hits:
                found.append(f"{rel}:{node.lineno} compares with {', '.join(hits)}")
    return found


def test_specs_carry_their_facts_no_name_is_compared_outside_its_package():
    # what a method or backend is (sharding, accumulation, episodes, a reference) is a fact of its
    # spec (workbench/methods/spec.py, workbench/backends/spec.py); comparing names elsewhere
    # spreads that knowledge over modules that a new method or backend would have to find
    assert name_comparisons() == []


def test_the_name_finder_finds_a_comparison(tmp_path):
    planted = ROOT / "workbench" / "plan" / "_planted_for_the_test.py"
    try:
        planted.write_text('def f(cfg):\n    return cfg.backend.name in ("fsdp2", "x") or cfg.method.name != "dpo"\n')
        found = name_comparisons({"planted": planted})
    finally:
        planted.unlink()
    assert found == ["workbench/plan/_planted_for_the_test.py:2 compares with fsdp2",
                     "workbench/plan/_planted_for_the_test.py:2 compares with dpo"] or \
        found == ["workbench/plan/_planted_for_the_test.py:2 compares with dpo, fsdp2"]


# Option reads (a method's outside workbench/methods/, a backend's outside workbench/backends/,
# aliases and getattr included) are found by tests/unit/test_option_reads.py.


# The runner builds the parts and hands each collaborator the few it needs (the loop's Parts,
# Checkpoints, Evaluator, finish.*): nothing receives the runner itself, so what a part reads is
# in its signature, not in a bag that grows.
def runner_handed_out(modules: dict | None = None) -> list[str]:
    """Where a Runner is passed along: `self` given as an argument inside class Runner, or a
    parameter annotated as the runner or named for it (`runner`; `r` in workbench/run/)."""
    found = []
    for path in (modules or MODULES).values():
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "Runner":
                for call in ast.walk(cls):
                    if isinstance(call, ast.Call) and any(isinstance(a, ast.Name) and a.id == "self"
                                                          for a in [*call.args, *(k.value for k in call.keywords)]):
                        found.append(f"{rel}:{call.lineno} hands the runner to {ast.unparse(call.func)}")
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in [*fn.args.args, *fn.args.kwonlyargs]:
                    note = ast.unparse(a.annotation) if a.annotation else ""
                    # `r` is the runner's short name in workbench/run/ (elsewhere a rank, a row, a rollout)
                    if a.arg == "runner" or (a.arg == "r" and rel.startswith("workbench/run/")) or "Runner" in note:
                        found.append(f"{rel}:{fn.lineno} {fn.name}() receives the runner as {a.arg}")
    return sorted(set(found))


def test_no_function_receives_the_runner():
    assert runner_handed_out() == []


def test_the_runner_finder_finds_both_forms():
    planted = ROOT / "workbench" / "run" / "_planted_for_the_test.py"
    try:
        planted.write_text("class Runner:\n    def go(self):\n        return helper(self)\n\n\n"
                           "def helper(r):\n    return r\n")
        found = runner_handed_out({"planted": planted})
    finally:
        planted.unlink()
    assert found == ["workbench/run/_planted_for_the_test.py:3 hands the runner to helper",
                     "workbench/run/_planted_for_the_test.py:6 helper() receives the runner as r"]


# The command line defers the run's modules until its import guards are set (bitsandbytes skipped
# when unused, transformers' incidental imports held back: workbench/core/imports.py), so
# `python -m workbench` stays light until a run needs them; launch/ imports each launcher when
# chosen; serve/__main__ (python -m workbench.serve) like cli. Everywhere else a module's workbench
# imports sit at its top: packages form layers, so no import has to hide in a function to break a
# cycle. Optional engines (deepspeed, megatron-core, ray, vllm, unsloth, trackers) are third-party
# packages, imported where chosen (tests/integration/test_optional_imports.py).
DEFERS_IMPORTS = {"workbench.cli", "workbench.launch.dispatch", "workbench.serve.__main__"}


def function_level_imports() -> list[str]:
    """Imports of workbench modules inside functions: outside DEFERS_IMPORTS any, inside it one
    without a comment (on its line or the line above) saying why."""
    found = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mod = node.module if isinstance(node, ast.ImportFrom) and node.level == 0 else \
                    node.names[0].name if isinstance(node, ast.Import) else None
                if not (mod or "").startswith("workbench"):
                    continue
                said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                if name not in DEFERS_IMPORTS or not said:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod} inside {fn.name}()")
    return sorted(set(found))


def test_workbench_imports_sit_at_the_top_of_modules():
    assert function_level_imports() == []


# docs/architecture.md: one section per layer listing LAYERS' modules, and the path of one run
# naming `module:function` (or `module:Class.method`) where each is defined.
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def architecture_mismatches() -> list[str]:
    text = ARCHITECTURE.read_text()
    found = []
    sections = re.split(r"^### \d+\. .*$", text.split("## The path of one run")[0], flags=re.M)[1:]
    if len(sections) != len(LAYERS):
        found.append(f"{len(sections)} layer sections, {len(LAYERS)} layers")
    for i, (section, prefixes) in enumerate(zip(sections, LAYERS), 1):
        listed = re.findall(r"`(workbench[\w.]*)`", section.split("Modules:", 1)[-1])
        if listed != prefixes:
            found.append(f"layer {i} lists {listed}, the test {prefixes}")
    for module, name in re.findall(r"`(workbench[\w.]*):([\w.]+)`", text):
        path = MODULES.get(module)
        if path is None:
            found.append(f"{module} is not a module")
            continue
        scope = ast.parse(path.read_text()).body
        for part in name.split("."):
            node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part), None)
            if node is None:
                found.append(f"{module}:{name} is not defined")
                break
            scope = node.body
    return found


def test_the_architecture_page_says_what_the_code_does():
    assert architecture_mismatches() == []
