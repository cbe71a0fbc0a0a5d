"""From a recipe to tokenised training examples: read, check, render, mask, truncate.

Each source becomes a list of (input_ids, labels). Bad rows stop the run with `file:line`
(data.on_bad_row=error) or are skipped and counted (skip). The fingerprint of a source covers
its bytes, the chat template and the tokenizer, so caches and manifests can name exactly
what was trained on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from workbench.data import formats
from workbench.data.recipes import Recipe, Source, messages_of, read_jsonl
from workbench.errors import UserError


@dataclass
class Tokenised:
    source: Source
    examples: list[tuple[list[int], list[int]]]
    skipped: int = 0
    truncated: int = 0
    fingerprint: str = ""
    bad: list[str] = field(default_factory=list)


def file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def conversations(source: Source):
    """Yield (where, messages) for each row of a chat source."""
    if source.format != "messages":
        raise UserError(f"{source.path}: format {source.format!r} is not supported for chat data (use messages)")
    for lineno, row in read_jsonl(source.path):
        yield f"{source.path}:{lineno}", row


def tokenise_source(source: Source, tokenizer, contract, data_cfg, loss_on="assistant") -> Tokenised:
    out = Tokenised(source, [])
    for where, row in conversations(source):
        try:
            msgs = messages_of(row, where)
        except UserError as exc:
            if data_cfg.on_bad_row == "skip":
                out.skipped += 1
                out.bad.append(str(exc))
                continue
            raise
        ids, labels = formats.tokenize_chat(tokenizer, msgs, contract, loss_on)
        if len(ids) > data_cfg.seq_len:
            ids, labels = ids[: data_cfg.seq_len], labels[: data_cfg.seq_len]
            out.truncated += 1
        if all(x == formats.IGNORE for x in labels[1:]):
            out.skipped += 1
            continue
        out.examples.append((ids, labels))
        if source.max_samples and len(out.examples) >= source.max_samples:
            break
    if not out.examples:
        raise UserError(f"{source.path}: no usable rows (empty source, or every row skipped)")
    out.fingerprint = hashlib.sha256(
        f"{file_digest(source.path)}|{contract.template_hash}|{tokenizer.name_or_path}|{data_cfg.seq_len}".encode()
    ).hexdigest()[:16]
    return out


def tokenise_recipe(recipe: Recipe, tokenizer, contract, data_cfg, loss_on="assistant") -> list[Tokenised]:
    return [tokenise_source(s, tokenizer, contract, data_cfg, loss_on) for s in recipe.sources]
