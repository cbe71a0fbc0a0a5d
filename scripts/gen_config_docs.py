"""Write docs/reference/config.md from the config itself: every config group with its choices
(conf/<group>/*.yaml), every key of the composed default config with its type, default and a
one-line description, and the options of every method, backend, launcher and tracker.

    python scripts/gen_config_docs.py          # rewrite the page
    python scripts/gen_config_docs.py --check  # exit 1 if the page is stale

Types come from the schema dataclasses (workbench/config/schema.py, each method's, backend's and
launcher's `Config`, the tracker options in schema.py), or from the value where a key has no
schema. Descriptions come from the trailing `# comment` of the key in the YAML file that sets it
(conf/train.yaml, the default choice's file; for a launcher's or tracker's options, the choice's
own file), else from the dataclass field's comment (trailing, or the comment lines just above
it); the method and backend options take the field's comment first, their conf/ file's after.
tests/unit/test_docs.py holds the committed page equal to this script's output, and every key
in it described.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONF = ROOT / "conf"
OUT = ROOT / "docs" / "reference" / "config.md"


# -- comments ------------------------------------------------------------------------------------
def _clean(lines: list[str]) -> str:
    """Comment lines as one line of Markdown: `|` escaped for tables, `<...>` outside code spans
    shown as text rather than read as HTML."""
    text = re.sub(r"\s+", " ", " ".join(ln.strip().lstrip("#").strip() for ln in lines)).strip()
    parts = text.split("`")
    parts[::2] = [s.replace("<", "&lt;").replace(">", "&gt;") for s in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def dataclass_comments(cls) -> dict[str, tuple[str, str]]:
    """field -> (annotation as written, comment) for a dataclass, read from its source file."""
    path = Path(inspect.getsourcefile(cls))
    source = path.read_text()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string
    lines = source.splitlines()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    out = {}
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        line = stmt.lineno
        comment = ""
        if line in trailing and not lines[line - 1].lstrip().startswith("#"):
            comment = _clean([trailing[line]])
        else:
            above, i = [], line - 2
            while i >= 0 and lines[i].lstrip().startswith("#"):
                above.insert(0, lines[i])
                i -= 1
            comment = _clean(above)
        out[stmt.target.id] = (ast.unparse(stmt.annotation), comment)
    return out


def _split_comment(line: str) -> tuple[str, str]:
    """A YAML line's content and its trailing comment (a ` #` outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i], line[i + 1:]
    return line, ""


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """dotted key -> its trailing comment in a YAML file (mappings only; lists are skipped)."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for raw in path.read_text().splitlines():
        content, comment = _split_comment(raw)
        if not content.strip() or content.lstrip().startswith("-"):
            continue
        m = re.match(r"^(\s*)([A-Za-z_][\w-]*)\s*:", content)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        dotted = ".".join(k for _, k in stack)
        if comment.strip():
            out[(prefix + "." if prefix else "") + dotted] = _clean([comment])
    return out


# -- the composed default config -----------------------------------------------------------------
def compose_default():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train")


def _show(value) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[" + ", ".join(_show(v).strip("`") for v in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else "`{" + ", ".join(f"{k}: {_show(v).strip('`')}" for k, v in value.items()) + "}`"
    if value == "":
        return '`""`'
    return f"`{value}`".replace("|", "\\|")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _kind(value) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict"}.get(type(value), "any")


def _flatten(node, prefix: str = ""):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, node


def _schema_fields() -> dict[str, tuple[str, str]]:
    """dotted key -> (type, comment) for every field of the schema dataclasses, nested ones too."""
    from workbench.config.schema import Schema

    out: dict[str, tuple[str, str]] = {}

    def walk(cls, prefix):
        comments = dataclass_comments(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            ann, comment = comments.get(f.name, ("", ""))
            out[key] = (ann, comment)
            if dataclasses.is_dataclass(f.type if not isinstance(f.type, str) else None):
                walk(f.type, key)
            else:
                sub = _nested_dataclass(cls, f.name)
                if sub is not None:
                    walk(sub, key)

    walk(Schema, "")
    return out


def _nested_dataclass(cls, name):
    """The dataclass a field holds: its type, or the one dataclass of an `X | None`."""
    import typing

    t = typing.get_type_hints(cls).get(name)
    if dataclasses.is_dataclass(t):
        return t
    inner = [a for a in typing.get_args(t) if dataclasses.is_dataclass(a)]
    return inner[0] if len(inner) == 1 and type(None) in typing.get_args(t) else None


def _defaults_list() -> dict[str, object]:
    from workbench.config.commandline import defaults as _defaults

    return _defaults()


# -- the page ------------------------------------------------------------------------------------
def _file_summary(path: Path) -> str:
    """The first comment paragraph of a conf file (after any `# @package` line, before an indented
    example command), as one line: whole when short, else its first sentences."""
    lines = []
    for ln in path.read_text().splitlines():
        s = ln.strip()
        if s.startswith("# @package"):
            continue
        if not s.startswith("#") or re.match(r"#\s{3,}\S", s):
            break
        lines.append(s)
    text = _clean(lines)
    if len(text) <= 220:
        return text
    out = ""
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z(`])", text):
        out = f"{out} {sentence}".strip()
        if len(out) > 100:
            break
    return out


def groups_section() -> list[str]:
    from workbench.config.commandline import choices as _choices
    from workbench.config.commandline import groups as _groups

    defaults = _defaults_list()
    lines = ["## Config groups", "",
             "Pick one choice per group with `group=choice` (`tracker` takes a list). Each choice is",
             "`conf/<group>/<choice>.yaml`; `(default)` marks the default, and a group whose default is",
             "*unset* is off unless chosen.", ""]
    groups = [*_groups(), "hydra/sweeper"]
    for group in groups:
        chosen = defaults.get(group) if group != "hydra/sweeper" else None
        chosen = chosen if isinstance(chosen, list) else [chosen]
        choices = _choices(group) if group != "hydra/sweeper" else \
            sorted(p.stem for p in (CONF / "hydra" / "sweeper").glob("*.yaml"))
        note = " (default: *unset*)" if chosen == [None] else ""
        lines += [f"### `{group}`{note}", "", "| choice | what it is |", "|---|---|"]
        for c in choices:
            name = f"`{c}` (default)" if c in chosen else f"`{c}`"
            lines.append(f"| {name} | {_file_summary(CONF / group / f'{c}.yaml')} |")
        lines.append("")
    return lines


def keys_section() -> list[str]:
    from omegaconf import OmegaConf

    from workbench.backends import registry as backends
    from workbench.methods import registry as methods

    cfg = compose_default()
    raw = OmegaConf.to_container(cfg, resolve=False)
    raw.pop("hydra", None)
    defaults = _defaults_list()
    schema = _schema_fields()
    comments: dict[str, str] = {}
    comments.update(yaml_comments(CONF / "train.yaml"))
    for group, choice in defaults.items():
        for c in choice if isinstance(choice, list) else [choice]:
            if not c or "/" in group:
                continue
            path = CONF / group / f"{c}.yaml"
            text = path.read_text()
            comments.update(yaml_comments(path, "" if "@package _global_" in text else group))
    # method and backend: the default choice's options dataclass fills in what its YAML leaves out
    plug = {"method": methods.spec(raw["method"]["name"]).config, "backend": backends.spec(raw["backend"]["name"]).config}
    for group, cls in plug.items():
        node = {f.name: _field_default(f) for f in dataclasses.fields(cls)}
        node.update(raw[group])
        raw[group] = node
        for name, (ann, comment) in dataclass_comments(cls).items():
            schema[f"{group}.{name}"] = (ann, comment)

    lines = ["## Keys of the default config", "",
             "What `python -m workbench` runs with (`python -m workbench --cfg job` prints it), merged onto",
             "the schemas; `method` and `backend` show every option of the default choices (`sft`,",
             "`single`; the other choices' options are below). Set any key with `key=value`; a group",
             "choice replaces its whole section. `${...}` values are resolved when the run starts.", ""]
    scalars = {k: v for k, v in raw.items() if not isinstance(v, dict)}
    sections = [("top-level keys", scalars), *((f"`{k}`", {k: v}) for k, v in raw.items() if isinstance(v, dict))]
    for title, node in sections:
        lines += [f"### {title}", "", "| key | type | default | description |", "|---|---|---|---|"]
        for key, value in _flatten(node):
            ann, doc = schema.get(key, ("", ""))
            doc = comments.get(key) or doc
            lines.append(f"| `{key}` | {_cell(ann) or _kind(value)} | {_show(value)} | {doc} |")
        lines.append("")
    return lines


def _field_default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def options_section(group: str, registry) -> list[str]:
    title = {"method": "Options of each method", "backend": "Options of each backend"}[group]
    lines = [f"## {title}", "",
             f"`{group}=<name>` picks the `Config` dataclass of `workbench/{group}s/<name>.py`; every field",
             f"can be set as `{group}.<field>=value`. Defaults are the dataclass's; a `conf/{group}/` alias",
             "may set other values (see its file).", ""]
    for name in registry.SPECS:
        cls = registry.spec(name).config
        comments = dataclass_comments(cls)
        path = CONF / group / f"{name}.yaml"
        fallback = yaml_comments(path, group) if path.exists() else {}
        lines += [f"### `{group}={name}`", "", "| key | type | default | description |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            ann, doc = comments.get(f.name, ("", ""))
            doc = doc or fallback.get(f"{group}.{f.name}", "")
            lines.append(f"| `{group}.{f.name}` | {_cell(ann)} | {_show(_field_default(f))} | {doc} |")
        lines.append("")
    return lines


def _choice_table(group: str, node: dict, cls, comments: dict[str, str]) -> list[str]:
    """One choice's keys: the YAML file's values, then the fields of its dataclass (cls, may be
    None) that the file leaves out; type from the dataclass, description from the file's comment
    else the dataclass field's."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
    notes = dataclass_comments(cls) if cls is not None else {}
    values = {**node, **{k: _field_default(f) for k, f in fields.items() if k not in node}}
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, value in values.items():
        ann, doc = notes.get(key, ("", ""))
        doc = comments.get(f"{group}.{key}") or doc
        lines.append(f"| `{group}.{key}` | {_cell(ann) or _kind(value)} | {_show(value)} | {doc} |")
    return lines


def _choice_node(path: Path, key: str | None = None) -> tuple[dict, dict[str, str]]:
    """A conf file's values, unresolved (`key`: only the node under it, as in a `# @package _global_`
    file or a tracker's), and its keys' comments, dotted from the file's top."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    raw.pop("defaults", None)
    return raw.get(key, {}) if key else raw, yaml_comments(path)


def launchers_section() -> list[str]:
    from workbench.config.commandline import choices as _choices
    from workbench.launch import dispatch as launch

    lines = ["## Options of each launcher", "",
             "`launcher=<name>` (`conf/launcher/<name>.yaml`) says where the run executes; each key is set",
             "as `launcher.<key>=value`, and only the chosen launcher reads its keys. Defaults are the",
             "file's; types come from the launcher module's `Config` (`workbench/launch/`), which refuses",
             "an unknown key when the run starts. `local` runs in this process, or under torchrun.", ""]
    for name in _choices("launcher"):
        path = CONF / "launcher" / f"{name}.yaml"
        glob = "@package _global_" in path.read_text()
        node, comments = _choice_node(path, "launcher" if glob else None)
        comments = {(k if glob else f"launcher.{k}"): v for k, v in comments.items()}
        cls = launch.LAUNCHERS[name]().Config if name in launch.LAUNCHERS else None
        lines += [f"### `launcher={name}`", "", *_choice_table("launcher", node, cls, comments), ""]
    return lines


def trackers_section() -> list[str]:
    from workbench.config.commandline import choices as _choices
    from workbench.config.schema import TrackerConfig

    lines = ["## Options of each tracker", "",
             "`tracker=[<name>,...]` (`conf/tracker/<name>.yaml`) picks any number of them; a chosen",
             "tracker's options are `tracker.<name>.<key>=value`. Defaults are the file's; types come from",
             "the tracker options in `workbench/config/schema.py`.", ""]
    for name in _choices("tracker"):
        path = CONF / "tracker" / f"{name}.yaml"
        node, comments = _choice_node(path, name)
        comments = {f"tracker.{k}": v for k, v in comments.items()}
        cls = _nested_dataclass(TrackerConfig, name)
        lines += [f"### `tracker={name}`", "", *_choice_table(f"tracker.{name}", node, cls, comments), ""]
    return lines


def render() -> str:
    from workbench.backends import registry as backends
    from workbench.methods import registry as methods

    lines = ["# Configuration reference", "",
             "Generated by `scripts/gen_config_docs.py` from `conf/` and the schema dataclasses",
             "(`workbench/config/schema.py`, each method's and backend's `Config`); a test holds this page",
             "equal to the script's output. `python -m workbench --help` lists the same groups and choices.", ""]
    lines += groups_section()
    lines += keys_section()
    lines += options_section("method", methods)
    lines += options_section("backend", backends)
    lines += launchers_section()
    lines += trackers_section()
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        ok = OUT.exists() and OUT.read_text() == text
        print("docs/reference/config.md is " + ("up to date" if ok else "stale: run python scripts/gen_config_docs.py"))
        return 0 if ok else 1
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
