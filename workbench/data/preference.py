"""Preference rows (DPO) and prompt rows (GRPO): normalise the accepted shapes, then tokenise.

Accepted preference rows (one JSON object per line):

    {"prompt": "text", "chosen": "text", "rejected": "text"}
    {"prompt": [messages], "chosen": [assistant messages], "rejected": [assistant messages]}
    {"chosen": [full conversation], "rejected": [full conversation]}   # shared prefix = prompt

Accepted prompt rows (GRPO): {"prompt": "text" | [messages], ...}; every other column (e.g.
`answer`) is handed to the reward functions by name.

Completions are tokenised exactly like SFT targets (chat.tokenize_chat): the generation
prompt, then the assistant text and the template's end-of-turn token, so what DPO scores is
what inference produces. A row in any other shape stops the run with `file:line` and the
list of accepted schemas. A pair whose chosen and rejected completions are the same tokens
carries no preference (loss log 2, zero gradient): it is counted, skipped and reported in one
line; a file with nothing else is refused. Tokenised pairs are cached by fingerprint beside the
SFT sources (workbench/data/cache.py), so a relaunch or resume reads them back.
"""

from __future__ import annotations

import hashlib
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from workbench.core.errors import UserError
from workbench.data import cache, chat, formats, pipeline
from workbench.data.chat import prompt_ids
from workbench.data.mixing import Mixture
from workbench.data.pair_tree import shared_prefix
from workbench.data.readers import fingerprint_parts, iter_rows
from workbench.data.recipes import Source, load_recipe
from workbench.train.distributed import is_main_process

PREFERENCE_SCHEMAS = (
    '{"prompt": str, "chosen": str, "rejected": str}; '
    '{"prompt": [messages], "chosen": [messages], "rejected": [messages]}; '
    '{"chosen": [full conversation], "rejected": [full conversation]}'
)
PROMPT_SCHEMAS = '{"prompt": str | [messages], ...extra columns for rewards (e.g. "answer")}'


def messages(value, where: str, what: str, role: str) -> list[dict]:
    """A string as one `role` message, or a checked list of {role, content} messages."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in value):
        return formats.check_messages(value, what, where)  # content types, roles: file:line, not Jinja
    raise UserError(f"{where}: '{what}' must be a string or a non-empty list of {{role, content}} messages")


def preference_row(row: dict, where: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt messages, chosen messages, rejected messages) of one row, checked."""
    if "chosen" not in row or "rejected" not in row:
        raise UserError(f"{where}: not a preference row (keys: {sorted(row)}); a preference method accepts: "
                        f"{PREFERENCE_SCHEMAS}")
    if "prompt" in row:
        prompt = messages(row["prompt"], where, "prompt", "user")
        chosen = messages(row["chosen"], where, "chosen", "assistant")
        rejected = messages(row["rejected"], where, "rejected", "assistant")
    else:
        full_c = messages(row["chosen"], where, "chosen", "assistant")
        full_r = messages(row["rejected"], where, "rejected", "assistant")
        n = shared_prefix(full_c, full_r)  # the prompt: the turns both conversations start with
        if n == 0 or n == len(full_c) or n == len(full_r):
            raise UserError(f"{where}: chosen and rejected conversations need a shared prompt and must differ "
                            f"after it; accepted: {PREFERENCE_SCHEMAS}")
        prompt, chosen, rejected = full_c[:n], full_c[n:], full_r[n:]
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if turns[-1]["role"] != "assistant":
            raise UserError(f"{where}: '{name}' must end with an assistant turn")
    return prompt, chosen, rejected


def tokenise_completion(tokenizer, contract, prompt: list[dict], turns: list[dict], p_ids: list[int]):
    """(input_ids, labels) of prompt + completion; labels only on the completion's assistant tokens."""
    ids, labels = chat.tokenize_chat(tokenizer, prompt + turns, contract, "assistant")
    # assistant turns inside a multi-turn prompt are context, not the compared completion
    labels = [chat.IGNORE] * len(p_ids) + labels[len(p_ids):]
    return ids, labels


@dataclass
class Pair:
    chosen: tuple[list[int], list[int]]  # (input_ids, labels)
    rejected: tuple[list[int], list[int]]
    prompt_len: int
    margin: float | None = None  # the row's optional `margin` column (method=rm)


def _margin(row: dict, where: str) -> float | None:
    """The row's optional `margin`: how far chosen should beat rejected (method=rm reads it)."""
    m = row.get("margin")
    if m is None:
        return None
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
        raise UserError(f"{where}: 'margin' must be a finite number (got {m!r})")
    return float(m)


@dataclass
class PreferenceSource:
    source: Source
    pairs: list[Pair]
    skipped: int = 0
    truncated: int = 0
    identical: int = 0  # pairs with chosen == rejected (after truncation): no preference, skipped
    fingerprint: str = ""
    bad: list[str] = field(default_factory=list)


def _fingerprint(source: Source, tokenizer, contract, seq_len: int) -> str:
    parts = "|".join(fingerprint_parts(source.path, getattr(source, "hub", None)))
    return hashlib.sha256(f"{parts}|{contract.template_hash}|{tokenizer.name_or_path}|"
                          f"{seq_len}".encode()).hexdigest()[:16]


def _check_format(source: Source, wanted: str, schemas: str) -> None:
    if source.format not in ("auto", wanted):
        raise UserError(f"{source.label}: format {source.format!r} is not usable here; this method reads "
                        f"format {wanted} (or auto): {schemas}")


def checked_rows(source: Source, parse, out, data_cfg):
    """parse(row, where) for each row of `source`; a row whose parse raises a UserError stops the
    run, or with data.on_bad_row=skip is counted in out.skipped / out.bad."""
    def skip(exc: UserError) -> None:
        if data_cfg.on_bad_row != "skip":
            raise exc
        out.skipped += 1
        out.bad.append(str(exc))

    for where, row in iter_rows(source, on_bad=skip):  # malformed lines as rows of the wrong shape
        try:
            parsed = parse(row, where)
        except UserError as exc:
            skip(exc)
            continue
        yield parsed


# Bump when what tokenise_preferences produces for the same rows changes: it names the cache entries.
PAIRS_VERSION = 1


def tokenise_preferences(source: Source, tokenizer, contract, data_cfg, tok_digest: str | None = None
                         ) -> PreferenceSource:
    """The source's pairs, from the tokenised-data cache when an earlier run (or rank) wrote them:
    a relaunch or resume does not re-tokenise (as workbench/data/pipeline.py does for SFT)."""
    _check_format(source, "preference", PREFERENCE_SCHEMAS)
    out = pipeline.through_cache(source, tokenizer, contract, data_cfg, f"pairs-v{PAIRS_VERSION}", tok_digest,
                                 lambda: _tokenise_pairs(source, tokenizer, contract, data_cfg), _load_pairs, _save_pairs)
    if out.identical and is_main_process():
        print(f"warning: {source.label}: skipped {out.identical} pair(s) whose chosen and rejected are "
              f"identical (no preference signal); {len(out.pairs)} pairs remain", file=sys.stderr)
    return out


def _save_pairs(entry: Path, out: PreferenceSource) -> None:
    """Chosen and rejected as examples 2i and 2i+1 of one TokenArrays (labels are the ids where
    trained, IGNORE elsewhere, which its mask holds); prompt lengths and margins in meta.json."""
    builder = cache.ArrayBuilder()
    for p in out.pairs:
        builder.add(*p.chosen)
        builder.add(*p.rejected)
    cache.save(entry, builder.build(), {
        "source": out.source.label, "pairs": len(out.pairs), "skipped": out.skipped, "truncated": out.truncated,
        "identical": out.identical, "bad": out.bad, "prompt_len": [p.prompt_len for p in out.pairs],
        "margin": [p.margin for p in out.pairs]})


def _load_pairs(entry: Path, source: Source) -> PreferenceSource | None:
    hit = cache.load_twins(entry, "pairs", ("prompt_len", "margin"))
    if hit is None:
        return None
    arrays, meta = hit
    pairs = [Pair(arrays[2 * i], arrays[2 * i + 1], meta["prompt_len"][i], meta["margin"][i])
             for i in range(meta["pairs"])]
    return PreferenceSource(source, pairs, meta["skipped"], meta["truncated"], meta["identical"], "", meta["bad"])


def _tokenise_pairs(source: Source, tokenizer, contract, data_cfg) -> PreferenceSource:
    out = PreferenceSource(source, [])
    def parse(row, where):
        return (*preference_row(row, where), _margin(row, where))

    for prompt, chosen, rejected, margin in checked_rows(source, parse, out, data_cfg):
        p_ids = chat.prompt_ids(tokenizer, prompt)
        seqs = []
        for turns in (chosen, rejected):
            ids, labels = tokenise_completion(tokenizer, contract, prompt, turns, p_ids)
            if len(ids) > data_cfg.seq_len:
                ids, labels = ids[: data_cfg.seq_len], labels[: data_cfg.seq_len]
                out.truncated += 1
            seqs.append((ids, labels))
        if any(all(x == chat.IGNORE for x in lab[1:]) for _, lab in seqs):
            out.skipped += 1  # the prompt alone fills seq_len: nothing to compare
            continue
        if seqs[0] == seqs[1]:
            out.identical += 1
            continue
        out.pairs.append(Pair(seqs[0], seqs[1], len(p_ids), margin))
        if source.max_samples and len(out.pairs) >= source.max_samples:
            break
    if not out.pairs and out.identical:
        raise UserError(f"{source.label}: every pair ({out.identical}) has identical chosen and rejected "
                        "completions; DPO needs pairs that differ")
    if not out.pairs:
        raise UserError(f"{source.label}: no usable preference rows; accepted: {PREFERENCE_SCHEMAS}")
    return out


@dataclass
class PromptSource:
    source: Source
    rows: list[dict]  # {"prompt": [messages], **extra columns}
    fingerprint: str = ""


def read_prompts(source: Source, tokenizer, contract, data_cfg) -> PromptSource:
    _check_format(source, "prompt_only", PROMPT_SCHEMAS)
    rows = []
    for where, row in iter_rows(source):
        if "prompt" not in row:
            hint = " (this looks like SFT data)" if "messages" in row else ""
            raise UserError(f"{where}: not a prompt row{hint} (keys: {sorted(row)}); method=grpo accepts: "
                            f"{PROMPT_SCHEMAS}")
        prompt = messages(row["prompt"], where, "prompt", "user")
        if prompt[-1]["role"] == "assistant":
            raise UserError(f"{where}: the prompt ends with an assistant turn; GRPO generates that turn")
        rows.append({**row, "prompt": prompt, "_where": where})
        if source.max_samples and len(rows) >= source.max_samples:
            break
    if not rows:
        raise UserError(f"{source.label}: no prompt rows; accepted: {PROMPT_SCHEMAS}")
    return PromptSource(source, rows, _fingerprint(source, tokenizer, contract, data_cfg.seq_len))


def pairs_from_rows(rows: list[dict], tokenizer, contract) -> list[Pair]:
    """Pairs of in-memory preference rows (the embedded held-out pairs), tokenised as in training."""
    out = []
    for i, row in enumerate(rows):
        p, c, r = preference_row(row, f"row {i}")
        ids = prompt_ids(tokenizer, p)
        out.append(Pair(tokenise_completion(tokenizer, contract, p, c, ids),
                        tokenise_completion(tokenizer, contract, p, r, ids), len(ids)))
    return out


def read_pairs(tokenizer, contract, data_cfg) -> tuple[list[PreferenceSource], object]:
    """The run's recipe (data.recipe) tokenised as pairs, and the Mixture over its sources:
    what DPO and the reference-free pair methods (methods/pairs.py) train on."""
    digest = pipeline.tokenizer_digest(tokenizer)
    sources = [tokenise_preferences(s, tokenizer, contract, data_cfg, digest)
               for s in load_recipe(data_cfg.recipe).sources]
    return sources, Mixture([len(s.pairs) for s in sources], [s.source.weight for s in sources],
                            seed=data_cfg.shuffle_seed)


def pairs_report(sources: list[PreferenceSource]) -> dict:
    """The manifest's data entry for pair sources."""
    return {s.source.name: {"pairs": len(s.pairs), "skipped": s.skipped, "truncated": s.truncated,
                            "fingerprint": s.fingerprint} for s in sources}
