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

    eval_split: 0.05        # optional: held-out rows (a fraction, a row count, or a file)
    dedup_key: mypkg.keys:question   # optional: rows with a held-out row's key leave training

Every key is checked: a typo names the field and the recipe file.

One file needs no recipe: `data.path=FILE` (or a list of files) with `data.eval_split=0.05 | 200 |
eval.jsonl`. `workbench.resolve.validate` turns those into an inline recipe (`data.recipe` holds it
as JSON, so the run's config.yaml records exactly what was read), and `load_recipe` reads it like
a file. The held-out rows are chosen deterministically (a fixed-seed permutation of row numbers,
the same for the same file and size) and are removed from the training view of every source;
`Recipe.eval_sources` reads exactly them (workbench/evals/ uses it). So is every training row
that asks what a held-out row asks: by default the same prompt, exactly (`prompt_key`); with
`data.dedup_key=package.module:function`, the same key, `function(row)` on each row as read (our
column names), so "27 + 64" can hold out "64 + 27" as well (workbench/data/arith.py canonical).

Rows are read with their file and line so every bad row can be reported as `file:line:`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from workbench.core.errors import UserError
from workbench.core.imports import user_function
from workbench.data.formats import FORMATS, detect_format, to_messages
from workbench.data.readers import iter_rows
from workbench.train.distributed import is_main_process

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
    # Held-out split: the 0-based ordinals of this source's rows that are held out, and which
    # view this Source is ("train": every other row; "eval": only those). None: every row.
    held_out: frozenset | None = None
    role: str | None = None

    @property
    def label(self) -> str:
        return str(self.hub or self.path)


SOURCE_KEYS = {"name", "path", "hub", "format", "weight", "max_samples", "columns", "split", "min_tokens",
               "max_tokens"}


@dataclass
class Recipe:
    name: str
    file: Path
    sources: list[Source]  # the training view (held-out rows removed)
    eval_sources: list[Source] = field(default_factory=list)  # the held-out view (empty: no split)
    eval_split: object = None
    dedup_key: str | None = None


SPLIT_SEED = 20240601  # fixed: the held-out rows depend only on the file's rows and the split size


DEFAULT_SPLIT = 0.05  # held out when data.path is given, an eval task needs held-out rows and no split is set
HELD_OUT_TASKS = ("loss", "preference", "reward", "reward_accuracy")


def inline_recipe(data_cfg, eval_tasks=()) -> str | None:
    """The recipe data.path / data.eval_split stand for, as JSON for data.recipe; None when unused."""
    paths = data_cfg.path
    split = data_cfg.eval_split
    if paths is not None and split is None and any(t in HELD_OUT_TASKS for t in eval_tasks or ()):
        split = DEFAULT_SPLIT

        if is_main_process():
            print(f"data: holding out {DEFAULT_SPLIT:.0%} of data.path's rows for eval.tasks={list(eval_tasks)} "
                  "(set data.eval_split to choose: a fraction, a row count or a file)", file=sys.stderr)
    key = getattr(data_cfg, "dedup_key", None)
    if key is not None:
        key_function(key)  # a bad module:function is reported before anything loads
        if split is None:
            raise UserError(f"data.dedup_key={key!r} keeps data.eval_split's held-out rows out of training; "
                            "set data.eval_split too")
    if paths is None and (split is None or str(data_cfg.recipe).lstrip().startswith("{")):
        return None  # nothing to do, or validated before (a launched job re-validates its config)
    spec: dict = {"name": "data.path"}

    if data_cfg.format != "auto" and data_cfg.format not in FORMATS:
        raise UserError(f"data.format={data_cfg.format!r} is not one of auto, {', '.join(FORMATS)}")
    if paths is not None:
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not paths:
            raise UserError("data.path is an empty list; give a data file or a list of files")
        sources = []
        for i, p in enumerate(paths):
            f = Path(str(p)).expanduser().resolve()
            if not f.exists():
                raise UserError(f"data.path: data file not found: {f}")
            sources.append({"name": f.stem if len(paths) == 1 else f"{i}_{f.stem}", "path": str(f),
                            "format": data_cfg.format})
        spec["sources"] = sources
    else:
        spec["extends"] = data_cfg.recipe  # a named recipe with a held-out split added
    if split is not None:
        spec["eval_split"] = _split_value(split)
    if key is not None:
        spec["dedup_key"] = key
    return json.dumps(spec)


def _split_value(split):
    """data.eval_split checked: a fraction in (0, 1), a row count >= 1, or an existing file."""
    if isinstance(split, bool):
        raise UserError(f"data.eval_split={split!r}: give a fraction (0.05), a row count (200) or a file")
    if isinstance(split, float):
        if not 0 < split < 1:
            raise UserError(f"data.eval_split={split}: a fraction must be between 0 and 1 (a count is an integer)")
        return split
    if isinstance(split, int):
        if split < 1:
            raise UserError(f"data.eval_split={split}: a row count must be >= 1")
        return split
    f = Path(str(split)).expanduser().resolve()
    if not f.exists():
        raise UserError(f"data.eval_split={split!r}: not a fraction, a row count or an existing file ({f})")
    return str(f)


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
    """A recipe by name, by .yaml path, or inline JSON (what data.path becomes); split applied."""
    if name.lstrip().startswith("{"):
        spec = json.loads(name)
        if "extends" in spec:
            base = load_recipe(spec["extends"])
            return _with_split(Recipe(base.name, base.file, base.sources), spec.get("eval_split"), Path.cwd(),
                               spec.get("dedup_key"))
        path = Path.cwd() / "data.path"  # paths in an inline recipe are absolute already
    else:
        path = recipe_path(name)
        try:
            spec = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise UserError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(spec, dict) or not spec.get("sources"):
        raise UserError(f"{path}: a recipe needs a non-empty 'sources' list")
    unknown = set(spec) - {"name", "sources", "eval_split", "dedup_key", "description"}
    if unknown:
        raise UserError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: name, sources, eval_split, dedup_key, "
                        "description")
    sources = []
    for i, s in enumerate(spec["sources"]):
        sources.append(_source(s, i, path))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise UserError(f"{path}: source names must be unique, got {names}")
    return _with_split(Recipe(spec.get("name", path.stem), path, sources), spec.get("eval_split"), path.parent,
                       spec.get("dedup_key"))


def prompt_key(row: dict) -> str:
    """What a row asks, exactly: its prompt, or the conversation before its last assistant turn
    (a lone user message as its text, so a chat row and a prompt row asking the same match)."""
    if "prompt" in row:
        p = row["prompt"]
    elif "text" in row and not {"messages", "conversations", "instruction"} & set(row):
        p = row["text"]
    else:
        try:
            msgs = to_messages(row, detect_format(row, "row"), "row")
        except UserError:  # a bad row is reported by the reader that trains on it, with its file:line
            msgs = [row]
        if isinstance(msgs, str):
            p = msgs
        else:
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
            p = msgs[:last]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], dict) and p[0].get("role") == "user":
        p = p[0].get("content")
    return p if isinstance(p, str) else json.dumps(p, sort_keys=True, ensure_ascii=False, default=str)


def key_function(spec: str | None):
    """The function rows are keyed by for a split: data.dedup_key's `module:function`, or prompt_key."""
    if spec is None:
        return prompt_key

    if not isinstance(spec, str) or spec.count(":") != 1:
        raise UserError(f"data.dedup_key={spec!r}: name a function as 'package.module:function' (row -> key)")
    return user_function(spec, "data.dedup_key")


_KEYS: dict = {}


def _row_keys(source: Source, dedup_key: str | None) -> list[bytes]:
    """A digest of every row's key, in order (so also the row count): one pass, remembered per
    process for the same file (size and mtime) and key, since preflight, the method and the eval
    tasks all load the recipe."""
    import hashlib


    st = source.path.stat() if source.path is not None and source.path.is_file() else None
    memo = (str(source.path), source.hub, source.split, tuple(sorted(source.columns.items())),
            (st.st_size, st.st_mtime_ns) if st else None, dedup_key)
    if memo not in _KEYS or st is None:
        fn, out = key_function(dedup_key), []
        # unreadable lines are not keyed: under data.on_bad_row=skip every reader passes them over,
        # so the held-out split's row ordinals agree; under error the data pipeline refuses them
        for where, row in iter_rows(source, on_bad=lambda exc: None):
            try:
                k = fn(row)
            except Exception as exc:  # noqa: BLE001 - the user's function fails in its own ways; name it and the row
                raise UserError(f"data.dedup_key={dedup_key!r} raised on {where}: {type(exc).__name__}: {exc}") from None
            out.append(hashlib.blake2b((k if isinstance(k, str) else repr(k)).encode(), digest_size=16).digest())
        _KEYS[memo] = out
    return _KEYS[memo]


_TOLD: set = set()


def _tell_dropped(n: int, recipe: Recipe, dedup_key: str | None) -> None:
    what = f"the same data.dedup_key ({dedup_key})" if dedup_key else "the same prompt"
    note = f"data: {n} training row(s) of {recipe.name} ask what a held-out row asks ({what}); left out of training"
    if n and note not in _TOLD and is_main_process():
        _TOLD.add(note)
        print(note, file=sys.stderr)


def _with_split(recipe: Recipe, split, base: Path, dedup_key: str | None = None) -> Recipe:
    """Apply a held-out split: train sources lose the held-out rows and every row sharing a
    held-out row's key; eval sources read only the held-out rows."""
    if split is None:
        return recipe
    import dataclasses
    import random

    if isinstance(split, str) and not isinstance(split, bool):
        f = (base / split).resolve()
        if not f.exists():
            raise UserError(f"{recipe.file}: eval_split file not found: {f}")
        ev = Source(name="eval", path=f, format=recipe.sources[0].format if len(recipe.sources) == 1 else "auto")
        held_keys = set(_row_keys(ev, dedup_key))
        train, dropped = [], 0
        for s in recipe.sources:
            mine = frozenset(i for i, k in enumerate(_row_keys(s, dedup_key)) if k in held_keys)
            dropped += len(mine)
            train.append(dataclasses.replace(s, held_out=mine, role="train") if mine else s)
        if dropped == sum(len(_row_keys(s, dedup_key)) for s in recipe.sources):
            raise UserError(f"data.eval_split={split}: every training row asks what a held-out row asks, "
                            "leaving nothing to train on")
        _tell_dropped(dropped, recipe, dedup_key)
        return Recipe(recipe.name, recipe.file, train, [ev], str(f), dedup_key)
    value = _split_value(split)
    keys = [_row_keys(s, dedup_key) for s in recipe.sources]
    total = sum(map(len, keys))
    k = max(1, round(value * total)) if isinstance(value, float) else value
    if k >= total:
        raise UserError(f"data.eval_split={split}: holds out {k} of {total} rows, leaving nothing to train on")
    # One permutation of all rows (sources in order): the first k are held out. Nested: a larger
    # split holds out a superset, and the same file and size always give the same rows.
    order = list(range(total))
    random.Random(SPLIT_SEED).shuffle(order)
    held = sorted(order[:k])
    flat = [x for ks in keys for x in ks]
    held_keys = {flat[i] for i in held}
    # Rows asking what a held-out row asks leave training too; the evaluation reads only the held-out rows.
    excluded = {i for i, x in enumerate(flat) if x in held_keys}
    if len(excluded) >= total:
        raise UserError(f"data.eval_split={split}: every training row asks what a held-out row asks, "
                        "leaving nothing to train on")
    _tell_dropped(len(excluded) - k, recipe, dedup_key)
    train, evals, start = [], [], 0
    for s, ks in zip(recipe.sources, keys):
        n = len(ks)
        mine = frozenset(i - start for i in held if start <= i < start + n)
        out = frozenset(i - start for i in excluded if start <= i < start + n)
        start += n
        train.append(dataclasses.replace(s, held_out=out, role="train"))
        if mine:
            evals.append(dataclasses.replace(s, held_out=mine, role="eval", max_samples=None))
    return Recipe(recipe.name, recipe.file, train, evals, value, dedup_key)


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
