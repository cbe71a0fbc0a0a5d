"""Data recipes: `data_recipes/<name>.yaml` declares the sources of a run and how to read them.

    name: arith_sft
    sources:
      - name: add2
        path: data/arith_add2_train.jsonl   # relative to the recipe file
        format: messages                    # see FORMATS
        weight: 1.0

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
    path: Path
    format: str = "messages"
    weight: float = 1.0
    max_samples: int | None = None
    columns: dict = field(default_factory=dict)  # our field name -> the file's column name


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
        if "path" not in s:
            raise UserError(f"{path}: sources[{i}] has no 'path'")
        src_path = (path.parent / s["path"]).resolve()
        if not src_path.exists():
            raise UserError(f"{path}: sources[{i}].path: data file not found: {src_path}")
        sources.append(Source(
            name=s.get("name", src_path.stem), path=src_path, format=s.get("format", "messages"),
            weight=float(s.get("weight", 1.0)), max_samples=s.get("max_samples"),
            columns=dict(s.get("columns") or {}),
        ))
    return Recipe(spec.get("name", path.stem), path, sources)


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
