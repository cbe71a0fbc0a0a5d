"""From a recipe to tokenised training examples: read, check, render, mask, filter, truncate, cache.

    sources = tokenise_recipe(load_recipe("arith_sft"), tokenizer, contract, cfg.data)
    sources[0].examples[i]  -> (input_ids, labels)      # labels are IGNORE outside trained spans

Rows stream from the source (workbench/data/readers.py) in chunks; each chunk's strings are
tokenised in one batch call. Bad rows stop the run with `file:line` and what was expected
(data.on_bad_row=error) or are skipped and counted (skip). The fingerprint of a source covers
its bytes, its recipe options, the chat template, the tokenizer and the sequence length; it
names the cache entry (workbench/data/cache.py), so a re-run or resume reads arrays instead of
re-tokenising, and the manifest names exactly what was trained on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import UserError
from workbench.data import cache, chat, formats, readers
from workbench.data.cache import ArrayBuilder, TokenArrays
from workbench.data.recipes import Recipe, Source

PIPELINE_VERSION = 3  # bump when tokenisation output changes for the same inputs
CHUNK_ROWS = 512
KEEP_BAD = 20  # bad-row messages kept for the report (the count is always exact)


@dataclass
class Tokenised:
    source: Source
    examples: TokenArrays
    skipped: int = 0
    truncated: int = 0
    filtered: int = 0
    rows_read: int = 0
    fingerprint: str = ""
    cached: bool = False
    bad: list[str] = field(default_factory=list)

    def report(self) -> dict:
        return {"rows": len(self.examples), "rows_read": self.rows_read, "skipped": self.skipped,
                "truncated": self.truncated, "filtered": self.filtered, "fingerprint": self.fingerprint,
                "cached": self.cached, "bad_rows": self.bad[:5]}


def tokenizer_digest(tokenizer) -> str:
    """Identity of the tokenizer's behaviour (vocab, merges, normaliser), not just its name."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    body = backend.to_str() if backend is not None and hasattr(backend, "to_str") else \
        json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{tokenizer.name_or_path}|{len(tokenizer)}|{body}".encode()).hexdigest()[:16]


def fingerprint(source: Source, tokenizer, contract, data_cfg, loss_on: str, tok_digest: str | None = None) -> str:
    parts = readers.fingerprint_parts(source.path, source.hub) + [
        f"format={source.format}", f"columns={sorted(source.columns.items())}", f"split={source.split}",
        f"cap={source.max_samples}", f"len={source.min_tokens},{source.max_tokens}",
        f"template={contract.template_hash}", f"eot={contract.end_of_turn_id}",
        f"tok={tok_digest or tokenizer_digest(tokenizer)}", f"seq_len={data_cfg.seq_len}", f"loss_on={loss_on}",
        f"bad={data_cfg.on_bad_row}", f"v={PIPELINE_VERSION}",
    ]
    if source.held_out is not None:  # the train and eval sides of a split are different data
        held = hashlib.sha256(",".join(map(str, sorted(source.held_out))).encode()).hexdigest()[:16]
        parts.append(f"split={source.role}:{held}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_entry(source: Source, data_cfg, fp: str) -> Path | None:
    """Where the source's tokens with fingerprint `fp` are cached (data.cache_dir, else
    $WORKBENCH_CACHE/tokenised); None with data.cache=false or for a hub source."""
    if not getattr(data_cfg, "cache", True) or source.hub is not None:
        return None
    return Path(getattr(data_cfg, "cache_dir", None) or cache.default_dir()) / fp


def through_cache(source: Source, tokenizer, contract, data_cfg, kind: str, tok_digest: str | None, build, load, save):
    """`build()`'s result for the source, or `load(entry, source)`'s where an earlier run (or rank)
    cached it under the fingerprint that `kind` (what is built, with its version) joins; a fresh
    result is handed to `save(entry, out)`. Its `.fingerprint` is set either way. The preference
    pairs and KTO's unpaired rows use it; the SFT sources keep their own path below (chunked
    tokenising and packing)."""
    fp = fingerprint(source, tokenizer, contract, data_cfg, kind, tok_digest)
    entry = cache_entry(source, data_cfg, fp)
    out = load(entry, source) if entry is not None else None
    if out is None:
        out = build()
        if entry is not None:
            save(entry, out)
    out.fingerprint = fp
    return out


def doc_end_id(tokenizer, contract) -> int:
    """What ends a plain-text document: the tokenizer's end-of-text token, else end-of-turn."""
    tid = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    known = tid is not None and tokenizer.convert_ids_to_tokens(int(tid)) == "<|endoftext|>"
    return int(tid) if known else contract.end_of_turn_id


class _Run:
    """Per-source counters and the bad-row policy."""

    def __init__(self, source: Source, data_cfg):
        self.source, self.policy = source, data_cfg.on_bad_row
        self.out = Tokenised(source, TokenArrays.empty())

    def bad(self, exc: UserError) -> None:
        if self.policy != "skip":
            raise exc
        self.out.skipped += 1
        if len(self.out.bad) < KEEP_BAD:
            self.out.bad.append(str(exc))


def _render_chunk(chunk, tokenizer, contract, loss_on, run: _Run, end_id: int):
    """Tokenise a chunk of (where, conversation | text); one batch call, per-row fallback on errors."""
    convs = [(w, c) for w, c in chunk if not isinstance(c, str)]
    texts = [(w, c) for w, c in chunk if isinstance(c, str)]
    results: dict[str, tuple] = {}
    try:
        for (w, _), r in zip(convs, chat.tokenize_chats(tokenizer, [c for _, c in convs], contract, loss_on)):
            results[w] = r
    except Exception:  # a template error in one row: find it, row by row
        for w, c in convs:
            try:
                results[w] = chat.tokenize_chat(tokenizer, c, contract, loss_on)
            except Exception as exc:  # jinja raises TemplateError, TypeError, ... for odd rows
                run.bad(UserError(f"{w}: the chat template could not render this row ({type(exc).__name__}: "
                                  f"{str(exc)[:120]})"))
    if texts:
        for (w, _), ids in zip(texts, chat._batch_ids(tokenizer, [t for _, t in texts])):
            ids = list(ids) + [end_id]
            results[w] = (ids, list(ids))
    return [(w, results[w]) for w, _ in chunk if w in results]


class _Ticker:
    """Progress of a long tokenisation on stderr: a line every 10 s, and one at the end when it
    took more than 2 s (small sources, the usual case, print nothing). Plain lines, so they read
    the same in a terminal and in CI or Slurm logs; the cached re-read skips all of this."""

    def __init__(self, label: str, every: float = 10.0, clock=None):
        import time

        self.label, self.every, self.clock = label, every, clock or time.perf_counter
        self.t0 = self.last = self.clock()

    def __call__(self, rows: int, examples: int, done: bool = False) -> None:
        now = self.clock()
        if (done and now - self.t0 > 2.0) or (not done and now - self.last >= self.every):
            self.last = now
            rate = rows / max(now - self.t0, 1e-9)
            state = "tokenised" if done else "tokenising"
            print(f"data: {self.label}: {state} {rows:,} rows -> {examples:,} examples "
                  f"({rate:,.0f} rows/s, {now - self.t0:.0f} s)", file=sys.stderr, flush=True)


def tokenise_source(source: Source, tokenizer, contract, data_cfg, loss_on="assistant",
                    tok_digest: str | None = None) -> Tokenised:
    fp = fingerprint(source, tokenizer, contract, data_cfg, loss_on, tok_digest)
    entry = cache_entry(source, data_cfg, fp)
    if entry is not None:
        hit = cache.load(entry)
        if hit is not None:
            arrays, meta = hit
            return Tokenised(source, arrays, meta["skipped"], meta["truncated"], meta["filtered"],
                             meta["rows_read"], fp, True, meta["bad"])
    run = _Run(source, data_cfg)
    out = run.out
    builder = ArrayBuilder()
    end_id = doc_end_id(tokenizer, contract)
    fmt = None if source.format == "auto" else source.format
    cap = source.max_samples
    seq_len = int(data_cfg.seq_len)  # read once: config attribute access is slow in the per-row loop
    chunk: list = []

    def flush():
        for where, (ids, labels) in _render_chunk(chunk, tokenizer, contract, loss_on, run, end_id):
            if cap and len(builder) >= cap:
                break
            if len(ids) < source.min_tokens or (source.max_tokens and len(ids) > source.max_tokens):
                out.filtered += 1
                continue
            if len(ids) > seq_len:
                ids, labels = ids[:seq_len], labels[:seq_len]
                out.truncated += 1
            if all(x == chat.IGNORE for x in labels[1:]):
                run.bad(UserError(f"{where}: no trained token left within data.seq_len={seq_len} "
                                  "(the prompt fills the window); raise seq_len or shorten the prompt"))
                continue
            builder.add(ids, labels)
        chunk.clear()

    tell = _Ticker(source.label)
    for where, row in readers.iter_rows(source, on_bad=run.bad):  # on_bad_row=skip: malformed lines too
        out.rows_read += 1
        try:
            if fmt is None:
                fmt = formats.detect_format(row, where)
            chunk.append((where, formats.to_messages(row, fmt, where)))
        except UserError as exc:
            run.bad(exc)
        if len(chunk) >= CHUNK_ROWS:
            flush()
            tell(out.rows_read, len(builder))
        if cap and len(builder) >= cap:
            break
    flush()
    tell(out.rows_read, len(builder), done=True)
    out.examples = builder.build()
    if not len(out.examples):
        why = f"; {out.skipped} bad rows skipped, e.g. {out.bad[0]}" if out.bad else ""
        why += f"; {out.filtered} outside min_tokens/max_tokens" if out.filtered else ""
        raise UserError(f"{source.label}: no usable rows in source {source.name!r}{why}")
    out.fingerprint = fp
    if entry is not None:
        cache.save(entry, out.examples, {"skipped": out.skipped, "truncated": out.truncated,
                                         "filtered": out.filtered, "rows_read": out.rows_read, "bad": out.bad,
                                         "source": source.label, "rows": len(out.examples)})
    return out


def tokenise_recipe(recipe: Recipe, tokenizer, contract, data_cfg, loss_on="assistant") -> list[Tokenised]:
    digest = tokenizer_digest(tokenizer)
    out = [tokenise_source(s, tokenizer, contract, data_cfg, loss_on, digest) for s in recipe.sources]
    for t in out:
        if t.skipped:  # on_bad_row=skip: say so once per source, with the first example
            print(f"data: source {t.source.name!r}: skipped {t.skipped} bad row(s) (data.on_bad_row=skip); "
                  f"first: {t.bad[0] if t.bad else '?'}", file=sys.stderr)
    return out
