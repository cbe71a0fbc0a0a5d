"""`data.preview=true` for the methods that do not read SFT rows: preference pairs (DPO, CPO,
ORPO, SimPO, the reward model), unpaired rows (KTO) and prompts (GRPO and relatives).

    python -m workbench method=dpo data.preview=true
    python -m workbench method=kto data.path=rows.jsonl data.preview=true

Each source is first read and tokenised in full by the same function training uses
(workbench/data/preference.py, unpaired.py), so its counts are training's and a row training
would refuse stops here too. The samples are then the first rows of the sources in file order
(taken from each source in turn), tokenised by the same per-row functions, each named by its
1-based file line and its format.
"""

from __future__ import annotations

import itertools

from workbench.core.errors import UserError
from workbench.data import preference, unpaired
from workbench.data.chat import IGNORE, prompt_ids
from workbench.data.readers import iter_rows, skip_bad
from workbench.data.recipes import load_recipe
from workbench.methods import registry
from workbench.run.preview import header, render, row_format, setup


def preview(cfg, shape: str, out=None) -> dict:
    """Print the header, one line per source and `data.preview_samples` samples; return them.
    `shape` is the data the method reads (workbench/methods/spec.py DATA_SHAPES): preference
    (DPO and relatives, the reward model), unpaired (KTO) or prompts (GRPO and relatives)."""
    tokenizer, contract, out, color = setup(cfg, out)
    recipe = load_recipe(cfg.data.recipe)
    show = {"preference": _pairs, "unpaired": _unpaired, "prompts": _prompts}[shape]
    print(header(cfg, recipe, contract, color), file=out)
    if registry.spec(cfg.method.name).facts.scalar_head:
        print(f"  (method={cfg.method.name}: the marks show each completion; the reward head reads its last token)",
              file=out)
    summaries = {}
    for s in recipe.sources:
        summaries[s.name] = _summary(shape, s, tokenizer, contract, cfg.data)
        print(f"  source {s.name}: " + ", ".join(f"{k} {v}" for k, v in summaries[s.name].items())
              + f", weight {s.weight}", file=out)
    samples = []
    for source, where, row in _first_rows(recipe.sources, cfg.data):
        for sample in show(cfg, source, where, row, tokenizer, contract, color):
            if len(samples) == cfg.data.preview_samples:
                break
            kind, rest = sample.pop("title").split(":", 1)  # "pair: where, ..." -> "pair 3: where, ..."
            print(f"\n--- {kind} {len(samples) + 1}:{rest} ---\n{sample.pop('shown')}", file=out)
            samples.append({"source": source.name, "where": where, **sample})
        if len(samples) == cfg.data.preview_samples:
            break
    return {"preview": samples, "sources": summaries}


def _summary(shape: str, source, tokenizer, contract, data_cfg) -> dict:
    """What training makes of the whole source (the tokenised-data cache keeps it for the run)."""
    if shape == "preference":
        s = preference.tokenise_preferences(source, tokenizer, contract, data_cfg)
        return {"pairs": len(s.pairs), "skipped": s.skipped, "identical pairs skipped": s.identical,
                "truncated": s.truncated}
    if shape == "unpaired":
        s = unpaired.tokenise_unpaired(source, tokenizer, contract, data_cfg)
        return {"examples": len(s.examples), "desirable": s.desirable, "undesirable": len(s.examples) - s.desirable,
                "skipped": s.skipped, "truncated": s.truncated}
    return {"prompts": len(preference.read_prompts(source, tokenizer, contract, data_cfg).rows)}


def _first_rows(sources, data_cfg):
    """(source, where, row) of the sources' rows in file order, one source after another in turn."""
    streams = [((s, where, row) for where, row in iter_rows(s, on_bad=skip_bad(data_cfg))) for s in sources]
    for item in itertools.chain.from_iterable(itertools.zip_longest(*streams)):
        if item is not None:
            yield item


def _fmt(source, row: dict, where: str, shape: str) -> str:
    """The format name, with how the row's shape is read where the name alone does not say."""
    name = row_format(source, row, where)
    if "prompt" not in row and "chosen" in row:  # whole conversations: the prompt is their shared start
        name = "preference (detected: chosen/rejected conversations, the prompt their shared start)"
    if shape == "unpaired" and "chosen" in row:
        name += ", each pair split into a desirable and an undesirable row"
    return name


def _cut(seq, seq_len: int):
    ids, labels = seq
    return ids[:seq_len], labels[:seq_len]


def _skip_bad(parse, row, where, data_cfg):
    """parse(row, where), or None for a bad row under data.on_bad_row=skip (training skips it)."""
    try:
        return parse(row, where)
    except UserError:
        if data_cfg.on_bad_row != "skip":
            raise
        return None


def _pairs(cfg, source, where, row, tokenizer, contract, color):
    parsed = _skip_bad(preference.preference_row, row, where, cfg.data)
    if parsed is None:
        return
    prompt, chosen, rejected = parsed
    p_ids = prompt_ids(tokenizer, prompt)
    seqs = [_cut(preference.tokenise_completion(tokenizer, contract, prompt, turns, p_ids), cfg.data.seq_len)
            for turns in (chosen, rejected)]
    trained = [sum(y != IGNORE for y in labels) for _, labels in seqs]
    n = len(p_ids)
    margin = f", margin {row['margin']}" if row.get("margin") is not None else ""
    shown = (render(tokenizer, seqs[0][0][:n], seqs[0][1][:n], color)
             + f"\n[chosen]   {render(tokenizer, seqs[0][0][n:], seqs[0][1][n:], color)}"
             + f"\n[rejected] {render(tokenizer, seqs[1][0][n:], seqs[1][1][n:], color)}")
    yield {"title": f"pair: {where}, format {_fmt(source, row, where, 'preference')}, prompt {n} tokens, "
                    f"chosen {trained[0]} trained, rejected {trained[1]} trained{margin}",
           "shown": shown, "format": _fmt(source, row, where, "preference"), "prompt_tokens": n,
           "trained": trained, "text": render(tokenizer, seqs[0][0][:n], seqs[0][1][:n], False),
           "chosen": render(tokenizer, seqs[0][0][n:], seqs[0][1][n:], False),
           "rejected": render(tokenizer, seqs[1][0][n:], seqs[1][1][n:], False)}


def _unpaired(cfg, source, where, row, tokenizer, contract, color):
    items = _skip_bad(unpaired.unpaired_rows, row, where, cfg.data) or []
    for prompt, turns, label in items:
        p_ids = prompt_ids(tokenizer, prompt)
        ids, labels = _cut(preference.tokenise_completion(tokenizer, contract, prompt, turns, p_ids), cfg.data.seq_len)
        trained = sum(y != IGNORE for y in labels)
        kind = "desirable" if label else "undesirable"
        yield {"title": f"example: {where} ({kind}), format {_fmt(source, row, where, 'unpaired')}, "
                        f"{len(ids)} tokens, {trained} trained",
               "shown": render(tokenizer, ids, labels, color), "format": _fmt(source, row, where, "unpaired"),
               "label": label, "tokens": len(ids), "trained": trained, "text": render(tokenizer, ids, labels, False)}


def _prompts(cfg, source, where, row, tokenizer, contract, color):
    if "prompt" not in row:  # read_prompts refused the source already unless it is all prompt rows
        return
    prompt = preference.messages(row["prompt"], where, "prompt", "user")
    ids = prompt_ids(tokenizer, prompt)
    extra = {k: v for k, v in row.items() if k != "prompt"}
    columns = ", ".join(f"{k}={v!r:.40}" for k, v in extra.items()) or "none"
    rewards = [f if isinstance(f, str) else f.get("name") for f in (cfg.get("reward") or {}).get("functions") or []]
    gen = registry.spec(cfg.method.name).generation(cfg.method)  # what the method generates per prompt
    shown = (tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
             + f"\n[generated in training: {gen.generations if gen else None} completions of up to "
               f"{gen.completion_len if gen else None} tokens, trained where sampled; "
               f"scored by {', '.join(map(str, rewards)) or 'no reward'}]")
    yield {"title": f"prompt: {where}, format {_fmt(source, row, where, 'prompts')}, {len(ids)} tokens, "
                    f"columns for the rewards: {columns}",
           "shown": shown, "format": _fmt(source, row, where, "prompts"), "tokens": len(ids), "columns": extra,
           "rewards": rewards, "text": tokenizer.decode(ids, skip_special_tokens=False)}
