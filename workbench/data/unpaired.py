"""Unpaired preference rows (KTO): one completion per row, labelled desirable or not.

Accepted rows (one JSON object per line), the shape detected per row:

    {"prompt": "text", "completion": "text", "label": true}              # true: desirable
    {"prompt": [messages], "completion": [assistant messages], "label": false}
    any preference row workbench/data/preference.py reads (prompt, chosen, rejected; or full
    chosen/rejected conversations), which becomes two rows: (prompt, chosen, true) and
    (prompt, rejected, false), as TRL's `unpair_preference_dataset` does

so the shipped arith_dpo pairs train KTO as they are:

    python -m workbench method=kto                          # data_recipes/arith_dpo.yaml, unpaired
    python -m workbench method=kto data.path=rows.jsonl     # your own (prompt, completion, label) rows

Completions are tokenised exactly like DPO's (preference.tokenise_completion): the generation
prompt, then the assistant text and the template's end-of-turn token. An example is kept as its
prompt ids and its completion ids and labels separately, because KTO's KL reference point joins
one example's prompt to another example's completion (workbench/methods/kto.py). A row of any
other shape stops the run with `file:line` and the accepted schemas; a row whose prompt alone
fills data.seq_len trains nothing and is skipped (counted). Tokenised rows are cached by
fingerprint beside the SFT sources and the pairs (workbench/data/cache.py), so a relaunch or
resume reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import UserError
from workbench.data import cache, chat, pipeline
from workbench.data.preference import PREFERENCE_SCHEMAS, checked_rows, messages, preference_row, tokenise_completion
from workbench.data.recipes import Source

UNPAIRED_SCHEMAS = (
    '{"prompt": str | [messages], "completion": str | [assistant messages], "label": true | false}; '
    "or preference rows, each split into a desirable and an undesirable row: " + PREFERENCE_SCHEMAS
)


def unpaired_rows(row: dict, where: str) -> list[tuple[list[dict], list[dict], bool]]:
    """(prompt messages, completion messages, desirable) for one row: one of them for an
    unpaired row, two (chosen: true, rejected: false) for a preference row."""
    if "completion" in row or "label" in row:
        missing = [k for k in ("prompt", "completion", "label") if k not in row]
        if missing:
            raise UserError(f"{where}: unpaired row without {missing} (keys: {sorted(row)}); method=kto accepts: "
                            f"{UNPAIRED_SCHEMAS}")
        if not isinstance(row["label"], bool):
            raise UserError(f"{where}: 'label' must be true (desirable) or false (undesirable), "
                            f"got {row['label']!r:.40}")
        prompt = messages(row["prompt"], where, "prompt", "user")
        completion = messages(row["completion"], where, "completion", "assistant")
        if completion[-1]["role"] != "assistant":
            raise UserError(f"{where}: 'completion' must end with an assistant turn")
        return [(prompt, completion, row["label"])]
    if "chosen" in row and "rejected" in row:
        prompt, chosen, rejected = preference_row(row, where)
        return [(prompt, chosen, True), (prompt, rejected, False)]
    hint = " (this looks like SFT data)" if {"messages", "conversations", "text"} & set(row) else ""
    raise UserError(f"{where}: not an unpaired or preference row{hint} (keys: {sorted(row)}); method=kto "
                    f"accepts: {UNPAIRED_SCHEMAS}")


@dataclass
class Unpaired:
    """One example: the prompt's ids, the completion's ids and labels (IGNORE outside the
    trained assistant tokens), both cut to data.seq_len, and whether it is desirable."""

    prompt: list[int]
    completion: tuple[list[int], list[int]]
    label: bool

    def sequence(self, seq_len: int, completion: tuple[list[int], list[int]] | None = None):
        """(input_ids, labels) of this prompt followed by `completion` (default: its own), cut to seq_len."""
        ids, labels = completion or self.completion
        return ((self.prompt + ids)[:seq_len], ([chat.IGNORE] * len(self.prompt) + labels)[:seq_len])


@dataclass
class UnpairedSource:
    source: Source
    examples: list[Unpaired]
    skipped: int = 0
    truncated: int = 0
    fingerprint: str = ""
    bad: list[str] = field(default_factory=list)

    @property
    def desirable(self) -> int:
        return sum(e.label for e in self.examples)


# Bump when what tokenise_unpaired produces for the same rows changes: it names the cache entries.
UNPAIRED_VERSION = 1


def tokenise_unpaired(source: Source, tokenizer, contract, data_cfg, tok_digest: str | None = None) -> UnpairedSource:
    """Read and tokenise one source, or read it back from the tokenised-data cache where an earlier
    run (or rank) wrote it; source.max_samples caps examples (a preference row gives two)."""
    if source.format not in ("auto", "preference", "unpaired"):
        raise UserError(f"{source.label}: format {source.format!r} is not usable here; method=kto reads format "
                        f"auto (or preference): {UNPAIRED_SCHEMAS}")
    return pipeline.through_cache(source, tokenizer, contract, data_cfg, f"unpaired-v{UNPAIRED_VERSION}", tok_digest,
                                  lambda: _tokenise(source, tokenizer, contract, data_cfg), _load, _save)


def _save(entry: Path, out: UnpairedSource) -> None:
    """Example i as entries 2i (its prompt, nothing trained) and 2i+1 (its completion's ids and
    labels) of one TokenArrays; the labels in meta.json."""
    builder = cache.ArrayBuilder()
    for e in out.examples:
        builder.add(e.prompt, [chat.IGNORE] * len(e.prompt))
        builder.add(*e.completion)
    cache.save(entry, builder.build(), {
        "source": out.source.label, "examples": len(out.examples), "skipped": out.skipped,
        "truncated": out.truncated, "bad": out.bad, "label": [e.label for e in out.examples]})


def _load(entry: Path, source: Source) -> UnpairedSource | None:
    hit = cache.load_twins(entry, "examples", ("label",))
    if hit is None:
        return None
    arrays, meta = hit
    examples = [Unpaired(arrays[2 * i][0], arrays[2 * i + 1], meta["label"][i]) for i in range(meta["examples"])]
    return UnpairedSource(source, examples, meta["skipped"], meta["truncated"], "", meta["bad"])


def _tokenise(source: Source, tokenizer, contract, data_cfg) -> UnpairedSource:
    out = UnpairedSource(source, [])
    seq_len = data_cfg.seq_len
    for items in checked_rows(source, unpaired_rows, out, data_cfg):
        p_ids = chat.prompt_ids(tokenizer, items[0][0])
        for prompt, turns, label in items:
            ids, labels = tokenise_completion(tokenizer, contract, prompt, turns, p_ids)
            if len(p_ids) >= seq_len:  # the prompt alone fills seq_len: no completion token to score
                out.skipped += 1
                continue
            out.truncated += len(ids) > seq_len
            # Nothing past seq_len tokens of a completion can enter any sequence (own or KL pair).
            done = (ids[len(p_ids):][:seq_len], labels[len(p_ids):][:seq_len])
            out.examples.append(Unpaired(p_ids[:seq_len], done, label))
        if source.max_samples and len(out.examples) >= source.max_samples:
            out.examples = out.examples[: source.max_samples]
            break
    if not out.examples:
        raise UserError(f"{source.label}: no usable unpaired rows; accepted: {UNPAIRED_SCHEMAS}")
    return out
