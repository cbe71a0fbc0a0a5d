"""The built-in evaluation tasks on the run's own data: `loss`, `preference`, `reward`,
`reward_accuracy`, `generate`.

    python -m workbench data.path=chat.jsonl data.eval_split=0.05 eval.tasks=[loss] eval.every_n_steps=50
    python -m workbench method=dpo data.path=pairs.jsonl data.eval_split=200 eval.tasks=[preference]
    python -m workbench method=grpo data.path=prompts.jsonl data.eval_split=0.1 eval.tasks=[reward]
    python -m workbench method=rm data.path=pairs.jsonl data.eval_split=200 eval.tasks=[reward_accuracy]
    python -m workbench eval.tasks=[generate] eval.prompts='[Write a haiku about rain]'

- `loss` (SFT): mean token loss and perplexity on the held-out rows (data.eval_split), the same
  tokens and loss mask as training;
- `preference` (DPO, KTO): on held-out pairs, reward accuracy and margins, rewards being
  beta * (policy - reference) log-probs; the reference is the model with its adapter switched
  off (peft) or, for full fine-tuning, the log-probs measured at the first evaluation (before
  training); without one only the policy's log-prob accuracy is reported. KTO's unpaired
  held-out rows (prompt, completion, label) have no pairs: there `accuracy` is the share of
  (desirable, undesirable) example pairs whose rewards are in that order (ties count half;
  0.5 before training), with the mean reward of each kind and their margin;
- `reward` (GRPO): the mean reward of greedy completions of held-out prompts, scored with the
  run's own reward functions;
- `reward_accuracy` (RM): on held-out pairs, the share where the reward model scores chosen above
  rejected, the mean margin and the mean chosen / rejected rewards;
- `generate`: greedy completions of `eval.prompts` (a list, or a .txt / .jsonl file), kept for the
  report so a person can read what training changed.

Each takes an `EvalContext` (workbench/evals/hooks.py) and returns {metric: value}; the caller
prefixes `eval/<task>/`. Held-out rows are tokenised once per run and cached in the context.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from workbench.core.errors import UserError
from workbench.data.collate import pad_batch
from workbench.data.pipeline import tokenise_source
from workbench.data.preference import read_prompts, tokenise_preferences
from workbench.data.readers import iter_rows, read_jsonl, skip_bad
from workbench.data.recipes import load_recipe
from workbench.data.unpaired import tokenise_unpaired, unpaired_rows
from workbench.methods import registry
from workbench.methods.logps import collate, sequence_logps
from workbench.methods.rm import pair_rewards
from workbench.models import value_head
from workbench.models.head import SelectiveLM
from workbench.rollout import rewards

# the built-ins that read held-out rows of the run's own data; each fits the methods whose
# default evaluation (workbench/methods/spec.py `eval`) it is
NEEDS_SPLIT = ("loss", "preference", "reward", "reward_accuracy")


def eval_recipe(cfg):
    """The recipe the run trains on, with its held-out view (Recipe.eval_sources)."""
    return load_recipe(cfg.data.recipe)


def check(task: str, cfg) -> None:
    """Preflight: the task fits the method and has held-out data (UserError otherwise)."""
    if task in NEEDS_SPLIT:
        method = cfg.method.name
        fits = registry.spec(method).facts.eval
        if task != fits:
            users = ", ".join(n for n, s in registry.SPECS.items() if s.facts.eval == task)
            raise UserError(f"eval.tasks: {task!r} is for method={users}; with method={method} use {fits!r} "
                            "(or generate, or your own module:function)")
        if not eval_recipe(cfg).eval_sources:
            raise UserError(f"eval.tasks: {task!r} needs held-out rows; set data.eval_split (a fraction such as "
                            "0.05, a row count, or a file)")
        if task == "preference" and registry.spec(method).facts.data == "unpaired":
            _both_labels(_held_out_labels(cfg))
        if task == "reward":  # the held-out prompt rows it reads carry what the reward functions read
            import itertools


            rows = (item for s in eval_recipe(cfg).eval_sources for item in iter_rows(s, on_bad=skip_bad(cfg.data)))
            rewards.check_columns(rewards.resolve(cfg.reward), itertools.islice(rows, cfg.eval.num_samples))
    if task == "generate":
        prompts(cfg.eval)


def prompts(eval_cfg) -> list[list[dict]]:
    """eval.prompts as conversations: a list of strings, or a file (.txt: one per line; .jsonl: prompt/messages)."""
    spec = eval_cfg.prompts
    if spec is None or (not isinstance(spec, str) and len(spec) == 0):
        raise UserError("eval.tasks: 'generate' needs eval.prompts (a list of prompts, or a .txt / .jsonl file)")
    if isinstance(spec, str):
        f = Path(spec).expanduser()
        if not f.exists():
            raise UserError(f"eval.prompts={spec!r}: file not found (for a single prompt write eval.prompts='[...]')")
        if f.suffix == ".jsonl":
            out = []
            for where, row in read_jsonl(f):
                p = row.get("messages") or row.get("prompt")
                if p is None:
                    raise UserError(f"{where}: expected {{\"prompt\": ...}} or {{\"messages\": [...]}}")
                out.append([{"role": "user", "content": p}] if isinstance(p, str) else list(p))
            return out
        return [[{"role": "user", "content": line}] for line in f.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": str(p)}] for p in spec]


def _held_out_labels(cfg) -> list[bool]:
    """The labels of the unpaired held-out examples `preference` will read (the first
    eval.num_samples), from the rows alone: preflight knows them before any weights load. A row
    that does not parse is left to the data pipeline, which names it."""
    labels: list[bool] = []
    for source in eval_recipe(cfg).eval_sources:
        for where, row in iter_rows(source, on_bad=skip_bad(cfg.data)):
            try:
                labels += [label for _prompt, _completion, label in unpaired_rows(row, where)]
            except UserError:
                continue
            if len(labels) >= cfg.eval.num_samples:
                return labels[: cfg.eval.num_samples]
    return labels


def _both_labels(labels) -> None:
    """KTO's held-out `preference` compares desirable with undesirable examples: it needs both."""
    labels = [bool(x) for x in labels]
    if labels and (all(labels) or not any(labels)):
        raise UserError("eval.tasks: 'preference' on unpaired held-out rows needs desirable and undesirable ones; "
                        f"the {len(labels)} held out are all {'desirable' if labels[0] else 'undesirable'} "
                        "(hold out more rows with data.eval_split, or give a held-out file with both)")


def _held_out(ctx, read) -> list:
    """The first eval.num_samples items `read(source, tokenizer, contract, data_cfg)` gives over
    the held-out sources."""
    out = []
    for s in eval_recipe(ctx.cfg).eval_sources:
        out += read(s, ctx.tokenizer, ctx.contract, ctx.cfg.data)
    return out[: ctx.eval_cfg.num_samples]


def _beta(ctx) -> float:
    """beta of the implicit rewards beta x (policy - reference): the method's, or DPO's default
    for a method without one (an SFT run's held-out pairs)."""
    default = registry.spec("dpo").config.beta
    return registry.spec(ctx.cfg.method.name).beta(ctx.cfg.method) or default


@contextlib.contextmanager
def _inference(model):
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _device(model):
    return next(model.parameters()).device


def loss(ctx) -> dict:
    """Held-out mean token loss and perplexity (SFT)."""
    import torch.nn.functional as F


    def examples():
        loss_on = registry.spec(ctx.cfg.method.name).loss_on(ctx.cfg.method)
        out = []
        for s in eval_recipe(ctx.cfg).eval_sources:
            t = tokenise_source(s, ctx.tokenizer, ctx.contract, ctx.cfg.data, loss_on)
            out += [t.examples[i] for i in range(len(t.examples))]
        return out[: ctx.eval_cfg.num_samples]

    rows = ctx.cached("loss/examples", examples)
    lm, device = SelectiveLM(ctx.model), _device(ctx.model)
    total, tokens = 0.0, 0
    with _inference(ctx.model):
        for i in range(0, len(rows), ctx.eval_cfg.batch_size):
            micro = {k: v.to(device) for k, v in pad_batch(rows[i:i + ctx.eval_cfg.batch_size],
                                                           ctx.tokenizer.pad_token_id).items()}
            with ctx.autocast_ctx():
                logits = lm(micro["input_ids"], micro["attention_mask"], select=micro["select"])
            total += float(F.cross_entropy(logits.float(), micro["targets"], reduction="sum"))
            tokens += int(micro["targets"].numel())
    mean = total / max(tokens, 1)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50.0)), "tokens": tokens, "n": len(rows)}


def preference(ctx) -> dict:
    """Held-out reward accuracy and margins (DPO)."""


    if registry.spec(ctx.cfg.method.name).facts.data == "unpaired" and _unpaired_held_out(ctx):
        return _unpaired_preference(ctx)
    rows = ctx.cached("preference/pairs", lambda: _held_out(ctx, lambda s, *a: tokenise_preferences(s, *a).pairs))
    bs, pad = ctx.eval_cfg.batch_size, ctx.tokenizer.pad_token_id
    pi, ref = _policy_and_reference(  # (2, pairs): chosen, rejected
        ctx, [collate(rows[i:i + bs], pad) for i in range(0, len(rows), bs)],
        lambda parts: torch.cat([x.view(2, -1) for x in parts], dim=1), "preference/reference")
    out = {"logp_accuracy": float((pi[0] > pi[1]).float().mean()), "n": len(rows)}
    if ref is not None:
        beta = _beta(ctx)
        rc, rr = beta * (pi[0] - ref[0]), beta * (pi[1] - ref[1])
        out.update(accuracy=float((rc > rr).float().mean()), margin=float((rc - rr).mean()),
                   chosen_reward=float(rc.mean()), rejected_reward=float(rr.mean()))
    return out


def _unpaired_held_out(ctx) -> bool:
    """Whether the held-out rows are KTO's unpaired ones (a row of pairs is read as pairs)."""
    for s in eval_recipe(ctx.cfg).eval_sources:
        for _where, row in iter_rows(s, s.columns or None, s.split, on_bad=skip_bad(ctx.cfg.data)):
            return "chosen" not in row
    return False


def _policy_and_reference(ctx, batches: list[dict], combine, key: str):
    """Per-row summed completion log-probs of the micro-batches under the policy and under the
    reference, each put together by `combine` (the list of per-batch results): the model with
    its adapter off (peft), else the policy's at the first evaluation, cached under `key`
    (None after it when there was none)."""
    model, device = ctx.model, _device(ctx.model)
    lm = SelectiveLM(model)

    def logps():
        out = []
        for micro in batches:
            with ctx.autocast_ctx():
                out.append(sequence_logps(lm, {k: v.to(device) for k, v in micro.items()}).float().cpu())
        return combine(out)

    with _inference(model):
        pi = logps()
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                return pi, logps()
        return pi, ctx.cached(key, lambda: pi.clone() if ctx.step == 0 else None)


def _unpaired_preference(ctx) -> dict:
    """`preference` on unpaired held-out rows (KTO): see the module docstring."""


    rows = ctx.cached("preference/unpaired", lambda: _held_out(ctx, lambda s, *a: tokenise_unpaired(s, *a).examples))
    labels = torch.tensor([e.label for e in rows])
    _both_labels(labels.tolist())  # checked in preflight too; a Runner built from Python skips that
    seqs, bs, pad = [e.sequence(ctx.cfg.data.seq_len) for e in rows], ctx.eval_cfg.batch_size, ctx.tokenizer.pad_token_id
    pi, ref = _policy_and_reference(ctx, [pad_batch(seqs[i:i + bs], pad) for i in range(0, len(seqs), bs)], torch.cat,
                                    "preference/unpaired_reference")
    out = {"n": len(rows)}
    if ref is None:
        return out
    r = _beta(ctx) * (pi - ref)
    good, bad = r[labels], r[~labels]
    order = (good[:, None] > bad[None, :]).float() + 0.5 * (good[:, None] == bad[None, :]).float()
    out.update(accuracy=float(order.mean()), margin=float(good.mean() - bad.mean()),
               desirable_reward=float(good.mean()), undesirable_reward=float(bad.mean()))
    return out


def reward(ctx) -> dict:
    """Mean reward of greedy completions of held-out prompts, with the run's reward functions (GRPO)."""
    items = ctx.cached("reward/rows", lambda: _held_out(ctx, lambda s, *a: read_prompts(s, *a).rows))
    fns = rewards.resolve(ctx.cfg.reward)
    gen = registry.spec(ctx.cfg.method.name).generation(ctx.cfg.method)  # the completions it trained on
    max_new = gen.completion_len if gen else int(ctx.eval_cfg.max_new_tokens)
    totals, per_fn, samples = [], [], []
    weights = torch.tensor([f.weight for f in fns])
    for i in range(0, len(items), ctx.eval_cfg.batch_size):
        chunk = items[i:i + ctx.eval_cfg.batch_size]
        convs = [r["prompt"] for r in chunk]
        ids = ctx.generate_ids(convs, max_new)
        texts = [ctx.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
        columns = {k: [r.get(k) for r in chunk] for k in chunk[0] if k not in ("prompt", "_where")}
        scores = rewards.score(fns, convs, texts, ids, columns, max_new_tokens=max_new)
        per_fn.append(scores)
        totals.append(scores @ weights)
        samples += [{"prompt": c[-1]["content"], "completion": t, "reward": float(s)}
                    for c, t, s in zip(convs, texts, scores @ weights)][: max(0, 5 - len(samples))]
    scores, total = torch.cat(per_fn), torch.cat(totals)
    out = {"mean": float(total.mean()), "n": len(items)}
    out.update({f"{f.name}": float(scores[:, j].mean()) for j, f in enumerate(fns)})
    out["_samples"] = samples
    return out


def reward_accuracy(ctx) -> dict:
    """Held-out pair accuracy of the reward model (method=rm): chosen scored above rejected."""
    if not value_head.is_attached(ctx.model):
        raise UserError("eval.tasks: 'reward_accuracy' needs a reward model (method=rm); this model has no scalar head")
    rows = ctx.cached("reward_accuracy/pairs", lambda: _held_out(ctx, lambda s, *a: tokenise_preferences(s, *a).pairs))
    r = pair_rewards(ctx.model, rows, ctx.tokenizer.pad_token_id, ctx.eval_cfg.batch_size, autocast=ctx.autocast)
    return {"accuracy": float((r[0] > r[1]).float().mean()), "margin": float((r[0] - r[1]).mean()),
            "chosen_reward": float(r[0].mean()), "rejected_reward": float(r[1].mean()), "n": len(rows)}


def generate(ctx) -> dict:
    """Greedy completions of eval.prompts, for the report (before / after training)."""
    convs = prompts(ctx.eval_cfg)
    ids = []
    for i in range(0, len(convs), ctx.eval_cfg.batch_size):
        ids += ctx.generate_ids(convs[i:i + ctx.eval_cfg.batch_size], ctx.eval_cfg.generate_max_new_tokens)
    texts = [ctx.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
    return {"n": len(convs), "mean_tokens": sum(len(x) for x in ids) / max(1, len(ids)),
            "_generations": [{"prompt": c[-1]["content"], "completion": t} for c, t in zip(convs, texts)]}


TASKS = {"loss": loss, "preference": preference, "reward": reward, "reward_accuracy": reward_accuracy,
         "generate": generate}
