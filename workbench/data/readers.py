"""Row readers for every source kind a recipe may name, each row tagged with where it came from.

    from workbench.data.readers import iter_rows, read_jsonl
    for where, row in iter_rows(source):        # where = "path/file.jsonl:17"
        ...
    for where, row in read_jsonl(path):         # one .jsonl file, rows as they are (eval prompts)

Kinds: `.jsonl`, `.json` (an array of objects), `.parquet`, `.csv`, a local Hugging Face
dataset directory (`save_to_disk` output), or a hub dataset id (only where the hub is
reachable). Files are read as streams (jsonl/csv line by line, parquet in record batches,
datasets through their memory-mapped arrow tables) so a large source is never held in memory
whole. A source's column mapping (`columns: {ours: theirs}`) is applied to every row here, so
callers only ever see our field names. Every problem names `file:line` (parquet and dataset
rows: the 1-based row number) and says what was expected.

Two common public shapes are recognised when a source's format is `auto` (`normalise`):
Anthropic-HH preference rows, where `chosen` and `rejected` are whole "\n\nHuman: ...\n\n
Assistant: ..." transcripts and the prompt is their shared beginning, become message lists
(plus `messages` = the chosen conversation, so SFT trains on it); GSM8K-style `question`/`answer`
rows gain `prompt`/`completion` (the answer, `#### n` line included, is the completion).
A source with a held-out split (recipes.py) yields only its training rows, or only its
held-out rows, by row ordinal.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from workbench.core.errors import UserError, missing_package

FILE_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def source_kind(path: Path | None, hub: str | None = None) -> str:
    """jsonl | json | parquet | csv | hf_dir | hub, or a UserError naming the path."""
    if hub:
        return "hub"
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists() \
                or (path / "state.json").exists():
            return "hf_dir"
        raise UserError(f"{path}: a directory source must be a Hugging Face dataset saved with save_to_disk "
                        "(dataset_info.json / dataset_dict.json not found)")
    kind = FILE_KINDS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"{path}: unknown file type {path.suffix!r}; expected one of {sorted(FILE_KINDS)}")
    return kind


def map_columns(row: dict, columns: dict, where: str) -> dict:
    """Rename the file's columns to ours (`columns: {ours: theirs}`); a mapped column must exist."""
    if not columns:
        return row
    out = dict(row)
    for ours, theirs in columns.items():
        if theirs not in row:
            raise UserError(f"{where}: column mapping {ours}: {theirs!r} names a column this row does not have "
                            f"(columns: {sorted(row)})")
        out[ours] = out.pop(theirs) if theirs != ours else row[theirs]
    return out


def iter_rows(source, columns: dict | None = None, split: str | None = None,
              on_bad: Callable[[UserError], None] | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (where, row) for a recipe `Source` (or a plain path), column mapping applied.

    `on_bad`: called with the UserError of a JSON-lines row that cannot be read (malformed, not an
    object) instead of raising it, and the reading goes on: data.on_bad_row=skip counts and skips
    such lines as it skips rows of the wrong shape (the callback raises under on_bad_row=error).
    An empty source is a UserError: a silent zero-row source would otherwise only show up as
    a mixture with a missing component.
    """
    held, role, auto = None, None, True
    if isinstance(source, (str, Path)):
        path, hub = Path(source), None
    else:
        path, hub = source.path, getattr(source, "hub", None)
        columns = source.columns if columns is None else columns
        split = getattr(source, "split", None) if split is None else split
        held, role = getattr(source, "held_out", None), getattr(source, "role", None)
        auto = getattr(source, "format", "auto") == "auto"
    kind = source_kind(path, hub)
    reader = {"jsonl": read_jsonl, "json": _json, "parquet": _parquet, "csv": _csv,
              "hf_dir": _hf_dir, "hub": _hub}[kind]
    label = hub if kind == "hub" else path
    rows = read_jsonl(label, split, on_bad) if kind == "jsonl" else reader(label, split)
    n = 0
    for ordinal, (where, row) in enumerate(rows):
        if held is not None and (ordinal in held) != (role == "eval"):
            continue  # the other side of the held-out split
        n += 1
        row = map_columns(row, columns or {}, where)
        yield where, normalise(row, where) if auto else row
    if n == 0:
        side = f" ({role} side of data.eval_split)" if role else ""
        raise UserError(f"{label}: empty source (no rows{f' in split {split!r}' if split else ''}{side})")


HH_TURN = re.compile(r"\n\n(Human|Assistant):[ \t]?")


def skip_bad(data_cfg) -> Callable[[UserError], None] | None:
    """iter_rows' `on_bad` for readers outside the data pipeline (evaluations, previews): under
    data.on_bad_row=skip an unreadable line is passed over there too (the pipeline counts it)."""
    return (lambda exc: None) if data_cfg.on_bad_row == "skip" else None


def hh_messages(text: str) -> list[dict] | None:
    """An Anthropic-HH transcript ("\n\nHuman: ...\n\nAssistant: ...") as messages; None if it is not one."""
    if not isinstance(text, str) or not text.startswith(("\n\nHuman:", "Human:")):
        return None
    parts = HH_TURN.split(text if text.startswith("\n\n") else "\n\n" + text)
    if parts[0].strip() or len(parts) < 5:  # text before the first turn, or no assistant turn
        return None
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)]


def normalise(row: dict, where: str) -> dict:
    """Recognise the HH and question/answer shapes (see the module docstring); other rows as they are."""
    if "prompt" not in row and "messages" not in row and isinstance(row.get("chosen"), str) \
            and isinstance(row.get("rejected"), str):
        chosen, rejected = hh_messages(row["chosen"]), hh_messages(row["rejected"])
        if chosen is not None and rejected is not None:
            for name, msgs in (("chosen", chosen), ("rejected", rejected)):
                if msgs[-1]["role"] != "assistant" or not msgs[-1]["content"]:
                    raise UserError(f"{where}: the '{name}' transcript does not end with a non-empty "
                                    "\\n\\nAssistant: turn")
            return {**row, "chosen": chosen, "rejected": rejected, "messages": chosen}
    if "question" in row and "answer" in row and not ({"prompt", "messages", "completion"} & set(row)):
        q, a = row["question"], row["answer"]
        if isinstance(q, str) and isinstance(a, str):
            return {**row, "prompt": q, "completion": a}
    return row


def _decode(raw: bytes, path, lineno: int) -> str:
    try:
        # utf-8-sig on the first line: editors on Windows start files with a byte-order mark
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start} of the line); "
                        "re-save the file as UTF-8") from None


def read_jsonl(path, split=None, on_bad: Callable[[UserError], None] | None = None) -> Iterator[tuple[str, dict]]:
    """(file:line, row) of every non-blank line of a JSON-lines file: a byte-order mark on the
    first line is skipped, and a malformed line, a truncated last line or a line that is not an
    object is a UserError naming file:line, raised, or handed to `on_bad` and skipped. `split` is
    unused (the iter_rows reader signature)."""
    for where, row in _jsonl_lines(path):
        if isinstance(row, UserError):
            if on_bad is None:
                raise row
            on_bad(row)
            continue
        yield where, row


def _jsonl_lines(path) -> Iterator[tuple[str, dict | UserError]]:
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        offset = 0
        for lineno, raw in enumerate(fh, 1):
            offset += len(raw)
            text = _decode(raw, path, lineno)
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                if offset == size and not raw.endswith(b"\n"):
                    yield "", UserError(f"{path}:{lineno}: the last line is truncated (invalid JSON and no final "
                                        f"newline: {_json_error(exc)}); was the file cut off while "
                                        "being written?")
                else:
                    yield "", UserError(f"{path}:{lineno}: malformed JSON ({_json_error(exc)}); "
                                        "expected one JSON object per line")
                continue
            if not isinstance(row, dict):
                yield "", UserError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
                continue
            yield f"{path}:{lineno}", row


def _json_error(exc: json.JSONDecodeError) -> str:
    """What is wrong and where on the line: "Expecting ',' delimiter at column 12". Some of json's
    messages end in "at" already ("Unterminated string starting at", "Invalid control character
    at"), and their column is the place they name."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def _json(path, split) -> Iterator[tuple[str, dict]]:
    """A JSON array of objects; elements are decoded one at a time so each gets its line number."""
    raw = Path(path).read_bytes()
    text = _decode_whole(raw, path)
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text):
        return
    if text[i] != "[":
        raise UserError(f"{path}:{text.count(chr(10), 0, i) + 1}: expected a JSON array of row objects "
                        "(for one object per line use .jsonl)")
    i = _skip_ws(text, i + 1)
    while i < len(text) and text[i] != "]":
        lineno = text.count("\n", 0, i) + 1
        try:
            row, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{exc.lineno}: malformed JSON ({_json_error(exc)})") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object in the array, got {type(row).__name__}")
        yield f"{path}:{lineno}", row
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
        elif i < len(text) and text[i] != "]":
            raise UserError(f"{path}:{text.count(chr(10), 0, i) + 1}: expected ',' or ']' between array elements")
    if i >= len(text):
        raise UserError(f"{path}:{text.count(chr(10)) + 1}: the JSON array is truncated (no closing ']')")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _decode_whole(raw: bytes, path) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = raw.count(b"\n", 0, exc.start) + 1
        raise UserError(f"{path}:{lineno}: not UTF-8 text ({exc.reason}); re-save the file as UTF-8") from None


def _csv(path, split) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as fb:
        # Decode line by line so a bad byte is reported at its line, then let csv parse the text.
        lines = (_decode(raw, path, n) for n, raw in enumerate(fb, 1))
        reader = csv.DictReader(lines)
        for row in reader:
            if None in row:
                raise UserError(f"{path}:{reader.line_num}: more fields than the header's {len(reader.fieldnames)}")
            if any(v is None for v in row.values()):
                raise UserError(f"{path}:{reader.line_num}: fewer fields than the header's {len(reader.fieldnames)}")
            yield f"{path}:{reader.line_num}", dict(row)


def _parquet(path, split) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise missing_package("pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid and friends
        raise UserError(f"{path}: not a readable parquet file ({exc})") from None
    n = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            n += 1
            yield f"{path}:{n}", row


def _hf_dir(path, split) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise missing_package("datasets") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        name = split or ("train" if "train" in ds else None)
        if name not in ds:
            raise UserError(f"{path}: split {split!r} not found; splits: {sorted(ds)}")
        ds = ds[name]
    for n, row in enumerate(ds, 1):
        yield f"{path}:{n}", row


def _hub(hub_id, split) -> Iterator[tuple[str, dict]]:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("WORKBENCH_OFFLINE") == "1":
        raise UserError(f"hub dataset {hub_id!r}: the hub is not reachable here (offline); download it and point "
                        "the source's path at the local file or save_to_disk directory")
    try:
        import datasets
    except ImportError:
        raise missing_package("datasets") from None
    try:
        ds = datasets.load_dataset(hub_id, split=split or "train", streaming=True)
    except Exception as exc:  # network and missing-dataset errors come in many types
        raise UserError(f"hub dataset {hub_id!r}: could not be opened ({type(exc).__name__}: {exc})") from None
    for n, row in enumerate(ds, 1):
        yield f"{hub_id}:{n}", row


def fingerprint_parts(path: Path | None, hub: str | None) -> list[str]:
    """What identifies a source's content: file sizes and mtimes are not enough, so hash bytes."""
    import hashlib

    if hub:
        return [f"hub:{hub}"]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    parts = []
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        parts.append(f"{f.name}:{h.hexdigest()[:16]}")
    return parts
