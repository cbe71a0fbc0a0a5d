"""`data.preview=true`: show what training will see, through the template and the loss mask, then stop.

    python -m workbench data.preview=true data.preview_samples=5
    python -m workbench data.preview=true data.recipe=my_mix data.chat_template=chatml
    python -m workbench method=dpo data.preview=true      # pairs: prompt, chosen and rejected
    python -m workbench method=kto data.preview=true      # unpaired rows, desirable or not
    python -m workbench method=grpo data.preview=true     # prompts, their reward columns, the rewards

Only the tokenizer is loaded (never model weights). Every source is read and tokenised exactly
as training reads it (so a row training would refuse stops the preview too, at its file:line);
each sample names the row's 1-based file line and its format (declared in the recipe, or
detected from the row's columns). For SFT the samples are the first ones of the training stream
itself (same recipe, mixture and seed), so what is shown is what step 1 trains; for the other
methods they are the first rows of each source in file order, one source after another in turn.
Trained tokens are shown in green on a terminal, and between ⟦ ⟧ otherwise; everything else is
context the model reads but is not trained to produce. A GRPO prompt has no trained tokens: its
completions are sampled by the policy during training. SFT rows and episodes are rendered here,
pairs, unpaired rows and prompts by workbench/run/preview_rows.py.

With an environment (`method=grpo env=calc data.preview=true`) each sample is a multi-turn
episode: the environment's demonstration of the first prompt rows (`demonstrate`) stands in for
the policy in the very episode loop training runs (workbench/rollout/episodes.py), so the marks
are the masks GRPO trains with: the sampled turns and their end-of-turn, never the prompt, the
tool results or the template's text between turns.
"""

from __future__ import annotations

import itertools
import sys

from workbench.core.errors import UserError
from workbench.data import formats
from workbench.data.chat import IGNORE, setup_tokenizer
from workbench.data.mixing import Mixture
from workbench.data.pipeline import tokenise_recipe
from workbench.data.preference import read_prompts
from workbench.data.readers import iter_rows, skip_bad
from workbench.data.recipes import load_recipe
from workbench.envs.base import check_node
from workbench.envs.registry import load
from workbench.methods import registry
from workbench.models.load import load_tokenizer
from workbench.rollout import episodes
from workbench.rollout.turns import Turns

OPEN, CLOSE = "⟦", "⟧"
GREEN, RESET = "\033[32;1m", "\033[0m"


def spans(ids: list[int], labels: list[int]) -> list[tuple[bool, list[int]]]:
    """Consecutive runs of (trained?, token ids)."""
    out: list[tuple[bool, list[int]]] = []
    for t, y in zip(ids, labels):
        trained = y != IGNORE
        if out and out[-1][0] == trained:
            out[-1][1].append(t)
        else:
            out.append((trained, [t]))
    return out


def render(tokenizer, ids: list[int], labels: list[int], color: bool = False) -> str:
    parts = []
    for trained, toks in spans(ids, labels):
        text = tokenizer.decode(toks, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if trained:
            text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
        parts.append(text)
    return "".join(parts)


def setup(cfg, out):
    """(tokenizer, chat contract, output stream, colour?) of a preview: the tokenizer only, no weights."""
    out = out or sys.stdout
    tokenizer = load_tokenizer(cfg.model)
    return tokenizer, setup_tokenizer(tokenizer, cfg.data.chat_template), out, hasattr(out, "isatty") and out.isatty()


def preview(cfg, out=None) -> dict:
    """Render the first `data.preview_samples` training samples of an SFT-shaped method, or the
    episodes of an environment (env=...); return them for callers and tests. The other methods'
    rows are workbench/run/preview_rows.py's."""
    tokenizer, contract, out, color = setup(cfg, out)
    if cfg.get("env") is not None:
        return preview_episodes(cfg, tokenizer, contract, out, color)
    loss_on = registry.spec(cfg.method.name).loss_on(cfg.method) if cfg.method is not None else "assistant"
    recipe = load_recipe(cfg.data.recipe)
    sources = tokenise_recipe(recipe, tokenizer, contract, cfg.data, loss_on)
    mixture = Mixture([len(s.examples) for s in sources], [s.source.weight for s in sources],
                      seed=cfg.data.shuffle_seed)
    print(header(cfg, recipe, contract, color), file=out)
    for s in sources:
        r = s.report()
        print(f"  source {s.source.name}: {r['rows']} examples (read {r['rows_read']}, skipped {r['skipped']}, "
              f"filtered {r['filtered']}, truncated {r['truncated']}), weight {s.source.weight}", file=out)
    samples = []
    for n in range(min(cfg.data.preview_samples, sum(len(s.examples) for s in sources))):
        src, row = mixture.next()
        ids, labels = sources[src].examples[row]
        trained = sum(y != IGNORE for y in labels)
        text = render(tokenizer, ids, labels, color)
        where, fmt = sft_origin(sources[src], row, skip_bad(cfg.data))
        print(f"\n--- sample {n + 1}: source {sources[src].source.name}, {where}, format {fmt}, {len(ids)} tokens, "
              f"{trained} trained ---\n{text}", file=out)
        samples.append({"source": sources[src].source.name, "row": row, "where": where, "format": fmt,
                        "tokens": len(ids), "trained": trained, "text": render(tokenizer, ids, labels, False)})
    return {"preview": samples, "sources": {s.source.name: s.report() for s in sources}}


def header(cfg, recipe, contract, color: bool) -> str:
    """The preview's first line: method, recipe, end-of-turn, template and how trained tokens show."""
    return (f"data preview: method={cfg.method.name}, recipe={recipe.name}, end-of-turn={contract.end_of_turn!r}, "
            f"template={contract.template_hash}; trained tokens shown "
            f"{'in green' if color else f'between {OPEN} {CLOSE}'}")


def row_format(source, row: dict, where: str) -> str:
    """The row's format: declared in the recipe, or detected from its columns (as training does)."""
    if source.format != "auto":
        return f"{source.format} (declared)"
    try:
        return f"{formats.detect_format(row, where)} (detected)"
    except UserError:
        return "unknown (detected)"


def sft_origin(tokenised, index: int, on_bad=None) -> tuple[str, str]:
    """(file:line, format) of a source's `index`-th example. Examples follow the rows one to one
    unless rows were skipped or filtered; then only the example's number is known. The format is
    the one training uses for the whole source: declared, or detected from its first row."""
    rows = iter_rows(tokenised.source, on_bad=on_bad)
    first_where, first = next(rows)
    fmt = row_format(tokenised.source, first, first_where)
    if tokenised.skipped or tokenised.filtered or tokenised.rows_read != len(tokenised.examples):
        return f"example {index + 1} of the source (rows were skipped or filtered)", fmt
    where, _row = (first_where, first) if index == 0 else next(itertools.islice(rows, index - 1, None))
    return where, fmt


def preview_episodes(cfg, tokenizer, contract, out, color: bool) -> dict:
    """Episodes of the environment's demonstrations through the episode loop, masks marked."""
    node = check_node(cfg.env)
    env = load(cfg.env)
    turns = Turns(tokenizer, contract, env.tools, node["tool_format"])
    note = turns.check()
    source = read_prompts(load_recipe(cfg.data.recipe).sources[0], tokenizer, contract, cfg.data)
    print(f"data preview: env={node['name']} (episodes of its demonstrations), recipe={cfg.data.recipe}, "
          f"format prompt_only, "
          f"end-of-turn={contract.end_of_turn!r}, template={contract.template_hash}, tool calls: {turns.format.family}, "
          f"tools {'by the template' if turns.native_tools else 'in a system message'}, results as "
          f"{turns.tool_role} messages; trained tokens shown {'in green' if color else f'between {OPEN} {CLOSE}'}"
          + (f"\nnote: {note}" if note else ""), file=out)
    samples = []
    for n, row in enumerate(source.rows[: cfg.data.preview_samples]):
        script = list(env.demonstrate(row, turns.format) or ["..."])

        def sample(prompts, first, script=script):  # the demonstration's next turn for the one episode
            text = script.pop(0) if script else "..."
            return [tokenizer(text, add_special_tokens=False)["input_ids"]]

        ep = episodes.run(env, turns, [row], sample, max_new_tokens=10**6, max_turns=node["max_turns"])[0]
        text = render(tokenizer, ep.ids, ep.labels, color)
        print(f"\n--- episode {n + 1}: {row['_where']}, {ep.turns} turns, {len(ep.ids)} tokens, {ep.sampled} trained"
              f"{f', cut at {ep.cut}' if ep.cut else ''} ---\n{text}", file=out)
        samples.append({"row": row["_where"], "tokens": len(ep.ids), "trained": ep.sampled, "turns": ep.turns,
                        "text": render(tokenizer, ep.ids, ep.labels, False)})
    return {"preview": samples}
