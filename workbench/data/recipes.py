"""Data recipes: `data_recipes/<name>.yaml` declares the sources of a run and how to read them.

    name: arith_sft
    sources:
      - name: add2
        path: data/arith_add2_train.jsonl   # relative to the recipe file (or `hub: org/name`)
        format: messages    # auto | messages | sharegpt | alpaca | prompt_completion | text | ...
        weight: 1.0         # share of the mix (normalised over sources)
        split: train        # for dataset dirs / hub ids with several splits
        columns: {messages: chat}   # our field name -> the file's column name
        max_samples: 1000   # cap on rows used from this source
        min_tokens: 8       # drop examples shorter / longer than this (before truncation)
        max_tokens: 2048

Every key is checked: a typo names the field and the recipe file.

Rows are read with their file and line so every bad row can be reported as `file:line:`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import yaml

from workbench.errors import UserError

RECIPES_DIR = Path(__file__).resolve().parents[2] / "data_recipes"


@dataclass
class Source:
    name: str
    path: Path | None
    format: str = "auto"
    weight: float = 1.0
    max_samples: int | None = None
    columns: dict = field(default_factory=dict)  # our field name -> the file's column name
    split: str | None = None
    hub: str | None = None
    min_tokens: int = 0
    max_tokens: int | None = None

    @property
    def label(self) -> str:
        return str(self.hub or self.path)


SOURCE_KEYS = {"name", "path", "hub", "format", "weight", "max_samples", "columns", "split", "min_tokens",
               "max_tokens"}


@dataclass
class Recipe:
    name: str
    file: Path
    sources: list[Source]


def recipe_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    p = RECIPES_DIR / f"{name}.yaml"
    if not p.exists():
        choices = sorted(f.stem for f in RECIPES_DIR.glob("*.yaml"))
        raise UserError(f"data.recipe={name!r}: no file {p}; recipes here: {choices}")
    return p


def load_recipe(name: str) -> Recipe:
    path = recipe_path(name)
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(spec, dict) or not spec.get("sources"):
        raise UserError(f"{path}: a recipe needs a non-empty 'sources' list")
    sources = []
    for i, s in enumerate(spec["sources"]):
        sources.append(_source(s, i, path))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: source names must be unique, got {names}")
    return Recipe(spec.get("name", path.stem), path, sources)


def _source(s, i: int, path: Path) -> Source:
    where = f"{path}: sources[{i}]"
    if not isinstance(s, dict):
        raise UserError(f"{where} must be a mapping with at least 'path' (or 'hub')")
    unknown = set(s) - SOURCE_KEYS
    if unknown:
        raise UserError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(SOURCE_KEYS)}")
    if ("path" in s) == ("hub" in s):
        raise UserError(f"{where} needs exactly one of 'path' (a local file or dataset dir) or 'hub' (a dataset id)")
    src_path = None
    if "path" in s:
        src_path = (path.parent / str(s["path"])).resolve()
        if not src_path.exists():
            raise UserError(f"{where}.path: data file not found: {src_path}")
    weight = s.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or weight <= 0:
        raise UserError(f"{where}.weight must be a number > 0, got {weight!r}")
    columns = s.get("columns") or {}
    if not isinstance(columns, dict) or not all(isinstance(v, str) for v in columns.values()):
        raise UserError(f"{where}.columns must map our field names to your column names, e.g. {{messages: chat}}")
    from workbench.data.formats import FORMATS

    fmt = s.get("format", "auto")
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"{where}.format={fmt!r} is not one of auto, {', '.join(FORMATS)}")
    for key in ("max_samples", "min_tokens", "max_tokens"):
        if s.get(key) is not None and (not isinstance(s[key], int) or s[key] < 0):
            raise UserError(f"{where}.{key} must be a non-negative integer, got {s[key]!r}")
    return Source(
        name=str(s.get("name", src_path.stem if src_path else s["hub"])), path=src_path, format=fmt,
        weight=float(weight), max_samples=s.get("max_samples"), columns=dict(columns), split=s.get("split"),
        hub=s.get("hub"), min_tokens=int(s.get("min_tokens") or 0), max_tokens=s.get("max_tokens"),
    )


def read_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, row); a malformed line is a UserError naming file:line."""
    try:
        fh = path.open(encoding="utf-8")
        with fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
                yield lineno, row
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def messages_of(row: dict, where: str) -> list[dict]:
    """The conversation in a `messages`-format row, checked."""
    msgs = row.get("messages")
    if msgs is None:
        raise UserError(f"{where}: row has no 'messages' field (keys: {sorted(row)}); expected "
                        "{\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: 'messages' must be a non-empty list")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{where}: messages[{j}] needs 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in msgs):
        raise UserError(f"{where}: no assistant turn to train on")
    return msgs
