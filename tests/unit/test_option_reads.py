"""A method's options are read by its own module and its spec (workbench/methods/), a backend's by
its own module (workbench/backends/); the config layer (workbench/config/) sets and checks both.
Everywhere else reads what the specs derive from them: MethodSpec.generation, reference_choice,
beta, loss_on, bound_generation for a method, BackendSpec.terms (stage, offload, expert
parallelism, checkpointing, accumulation sync, optimizer) for a backend. So a new option, a
changed default or a new backend with options of its own is one module, and the planner, the
resolved run and resume need no edit. `name` is the key to the spec and may be read anywhere.

    python -m pytest -q tests/unit/test_option_reads.py

The finder reads the source (ast). A read is any of

    cfg.method.beta    ctx.cfg.backend.stage    pick(cfg, "backend.ep")    OmegaConf.select(c, "method.beta")
    getattr(cfg.method, "loss_on", ...)    hasattr(cfg.backend, "ep")    "beta" in cfg.method
    m = cfg.method; m.beta    b = cfg.get("backend"); b.get("stage"), b["stage"]    pick(cfg, f"backend.{x}")
    for k in ("tp", "pp"): b[k]    {k: b[k] for k in ("tp", "pp") if k in b}

where `cfg` is anything config-like (`cfg`, `c`, `ctx.cfg`, `self.cfg`, `run_cfg`...) and an alias
is a name bound to an options node in the same function or one that encloses it; a loop name
over literal option names (`for k in ("tp", "pp")`) reads each of them.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT
from tests.unit.test_layout import MODULES

OWNERS = {"method": ("workbench/methods/", "workbench/config/"),
          "backend": ("workbench/backends/", "workbench/config/")}
FREE = {"name"}  # the key to the spec: read anywhere
_PATH = re.compile(r"(method|backend)\.([a-z_]+)")
_DYNAMIC = re.compile(r"(method|backend)\.$")  # the head of f"backend.{field}"
_PATH_READERS = {"pick", "select"}  # calls whose string argument is a dotted config path
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _config_like(node: ast.AST) -> bool:
    """`cfg`, `c`, `ctx.cfg`, `self.cfg`, `out`...: a name or attribute that holds a run config."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name in ("cfg", "c", "out", "changed", "run_cfg") or name.endswith("_cfg")


def _text(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _kind(expr: ast.AST, aliases: dict) -> str | None:
    """'method' or 'backend' where `expr` is a config's options node: `cfg.method`,
    `cfg.get("backend")`, `cfg["method"]`, or a name bound to one; else None."""
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id)
    if isinstance(expr, ast.Attribute) and expr.attr in OWNERS and _config_like(expr.value):
        return expr.attr
    if isinstance(expr, ast.Subscript) and _text(expr.slice) in OWNERS and _config_like(expr.value):
        return _text(expr.slice)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get" \
            and expr.args and _text(expr.args[0]) in OWNERS and _config_like(expr.func.value):
        return _text(expr.args[0])
    return None


def _keys(node: ast.AST, loops: dict) -> list[str]:
    """The option names `node` stands for as a key: a string, or a loop name over literal ones."""
    if _text(node):
        return [_text(node)]
    return loops.get(node.id, []) if isinstance(node, ast.Name) else []


def _reads(node: ast.AST, aliases: dict, loops: dict | None = None) -> list[tuple[str, str]]:
    """The (kind, option) pairs `node` itself reads; `loops`: loop names bound to literal names."""
    loops = loops or {}
    out = []
    if isinstance(node, ast.Attribute) and (kind := _kind(node.value, aliases)):
        if node.attr not in ("get", "pop", "setdefault", "items", "keys", "values"):  # the node's own methods
            out.append((kind, node.attr))
    elif isinstance(node, ast.Subscript) and (kind := _kind(node.value, aliases)):
        out += [(kind, k) for k in _keys(node.slice, loops)]
    elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
            and (kind := _kind(node.comparators[0], aliases)):
        out += [(kind, k) for k in _keys(node.left, loops)]
    elif isinstance(node, ast.Call):
        func = node.func
        fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if isinstance(func, ast.Attribute) and func.attr in ("get", "pop", "setdefault") and node.args \
                and (kind := _kind(func.value, aliases)):
            out += [(kind, k) for k in _keys(node.args[0], loops)]
        if fname in ("getattr", "hasattr") and len(node.args) >= 2 and (kind := _kind(node.args[0], aliases)):
            out += [(kind, k) for k in _keys(node.args[1], loops)]
        for arg in node.args:
            if (m := _PATH.fullmatch(_text(arg) or "")):
                out.append((m.group(1), m.group(2)))
            elif fname in _PATH_READERS and isinstance(arg, ast.JoinedStr) and arg.values \
                    and (m := _DYNAMIC.fullmatch(_text(arg.values[0]) or "")):
                out.append((m.group(1), "<" + ast.unparse(arg) + ">"))  # an option chosen at run time
    return [(k, o) for k, o in out if o not in FREE]


def _scope(body: list, inherited: dict, found: list, rel: str) -> None:
    """Reads in one function (or the module) body; nested functions are scopes of their own that
    see this one's aliases unless they bind the name again."""
    aliases = dict(inherited)
    nested, nodes, stack = [], [], list(body)
    while stack:  # this scope's nodes, not those of the functions inside it
        node = stack.pop()
        if isinstance(node, _SCOPES):
            nested.append(node)
            continue
        nodes.append(node)
        stack.extend(ast.iter_child_nodes(node))
    for node in nodes:  # bindings first: an alias may be read above the line that binds it in a loop
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None else []
        for t in targets:
            if isinstance(t, ast.Name):
                kind = _kind(node.value, aliases)
                if kind:
                    aliases[t.id] = kind
                else:
                    aliases.pop(t.id, None)
    loops = {}  # loop names over literal option names: for k in ("tp", "pp"), comprehensions too
    for node in nodes:
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                and isinstance(node.iter, (ast.Tuple, ast.List, ast.Set)) and node.iter.elts \
                and all(_text(e) for e in node.iter.elts):
            loops[node.target.id] = [_text(e) for e in node.iter.elts]
    for node in nodes:
        line = getattr(node, "lineno", None)
        found += [f"{rel}:{line} reads {k}.{o}" for k, o in _reads(node, aliases, loops) if line]
    for fn in nested:
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        body = [fn.body] if isinstance(fn, ast.Lambda) else fn.body
        _scope(body, {k: v for k, v in aliases.items() if k not in params}, found, rel)


def option_reads(modules: dict | None = None) -> list[str]:
    """Where a module reads a method option outside OWNERS["method"], or a backend option outside
    OWNERS["backend"]."""
    found: list[str] = []
    for path in (modules or MODULES).values():
        rel = path.relative_to(ROOT).as_posix()
        reads: list[str] = []
        _scope(ast.parse(path.read_text()).body, {}, reads, rel)
        found += [r for r in reads if not rel.startswith(OWNERS[r.split(" reads ")[1].split(".")[0]])]
    return sorted(set(found), key=lambda r: (r.split(":")[0], int(r.split(":")[1].split(" ")[0]), r))


def test_method_options_are_read_by_the_method_and_the_config_layer_only():
    assert [r for r in option_reads() if " reads method." in r] == []


def test_backend_options_are_read_by_the_backend_and_the_config_layer_only():
    # the planner, the resolved run and resume read BackendSpec.terms: a backend with offload or
    # parallel options of its own adds no planner code
    assert [r for r in option_reads() if " reads backend." in r] == []


def _planted(text: str) -> list[str]:
    planted = ROOT / "workbench" / "plan" / "_planted_option_read.py"
    try:
        planted.write_text(text)
        return option_reads({"planted": planted})
    finally:
        planted.unlink()


def test_the_option_finder_finds_the_direct_forms():
    found = _planted('def f(cfg, ctx):\n    return pick(cfg, "method.beta", 0) + ctx.cfg.method.max_new_tokens'
                               ' + len(cfg.method.name)\n')
    assert found == ["workbench/plan/_planted_option_read.py:2 reads method.beta",
                     "workbench/plan/_planted_option_read.py:2 reads method.max_new_tokens"]


def test_the_option_finder_finds_aliases_and_getattr():
    found = _planted(
        'def f(cfg, ctx):\n'
        '    m = cfg.method\n'
        '    def inner():\n'
        '        return m.vllm_sleep_level\n'
        '    return getattr(ctx.cfg.method, "loss_on", "x"), m.get("num_generations"), m.name, "beta" in m\n'
        'def g(m):\n'
        '    return m.beta  # a parameter, not the alias above\n')
    assert found == ["workbench/plan/_planted_option_read.py:4 reads method.vllm_sleep_level",
                     "workbench/plan/_planted_option_read.py:5 reads method.beta",
                     "workbench/plan/_planted_option_read.py:5 reads method.loss_on",
                     "workbench/plan/_planted_option_read.py:5 reads method.num_generations"]


def test_the_option_finder_finds_backend_reads_in_every_form():
    found = _planted(
        'def f(cfg, run, field):\n'
        '    b = cfg.get("backend")\n'
        '    return (pick(cfg, "backend.stage", 0), run.cfg.backend.cpu_offload, getattr(cfg.backend, "ep", 1),\n'
        '            b.get("offload_param"), b["selective_every"], b.name, cfg["backend"].distributed_optimizer,\n'
        '            pick(cfg, f"backend.{field}", None))\n')
    rel = "workbench/plan/_planted_option_read.py"
    assert found == [f"{rel}:3 reads backend.cpu_offload", f"{rel}:3 reads backend.ep", f"{rel}:3 reads backend.stage",
                     f"{rel}:4 reads backend.distributed_optimizer", f"{rel}:4 reads backend.offload_param",
                     f"{rel}:4 reads backend.selective_every", f"{rel}:5 reads backend.<f'backend.{{field}}'>"]


def test_the_option_finder_finds_reads_in_a_loop_over_names():
    found = _planted(
        'def f(cfg):\n'
        '    b = cfg.get("backend")\n'
        '    par = {k: int(b[k]) for k in ("tp", "pp") if k in b}\n'
        '    for key in ["cp"]:\n'
        '        par[key] = getattr(cfg.backend, key, 1)\n'
        '    return par\n')
    rel = "workbench/plan/_planted_option_read.py"
    assert found == [f"{rel}:3 reads backend.pp", f"{rel}:3 reads backend.tp", f"{rel}:5 reads backend.cp"]


def test_the_owners_may_read_their_own_options():
    planted = ROOT / "workbench" / "backends" / "_planted_option_read.py"
    try:
        planted.write_text('def terms(cfg):\n    return cfg.backend.stage, cfg.method.beta\n')
        found = option_reads({"planted": planted})
    finally:
        planted.unlink()
    assert found == ["workbench/backends/_planted_option_read.py:2 reads method.beta"]


def test_each_backend_maps_the_options_its_facts_name_into_its_terms():
    # fit.py names facts.checkpointing_field, optimizer_offload and accumulation_sync_field in the
    # overrides it suggests; the terms must read those same options, or a suggested fix would
    # change nothing the planner counts
    from omegaconf import OmegaConf

    from workbench.backends import registry as backends

    checked = []
    for name, spec in backends.SPECS.items():
        f = spec.facts
        node = OmegaConf.structured(spec.config)
        for field, value, term, expected in [(f.checkpointing_field, "full", "checkpointing", "full"),
                                             (f.optimizer_offload, "cpu", "offload_optimizer", True),
                                             (f.accumulation_sync_field, "false", "accum_sync", "false")]:
            if field:
                changed = OmegaConf.merge(node, {field: value})
                assert getattr(spec.terms(changed), term) == expected, (name, field)
                checked.append(f"{name}.{field}")
    assert len(checked) >= 3  # FSDP2's two, DeepSpeed's and Megatron's at least
