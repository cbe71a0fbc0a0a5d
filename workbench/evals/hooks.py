"""Evaluation hooks: what `eval.tasks` can name, run before/after (and every N steps of) training.

    python -m workbench eval.tasks=[arith_add2]                                  # the embedded task
    python -m workbench data.path=chat.jsonl data.eval_split=0.05 eval.tasks=[loss,generate] \
        eval.prompts='[Explain LoRA in one sentence]' eval.every_n_steps=50
    python -m workbench eval.tasks=[loss,mypkg.evals:exact_match]                # your own hook

A registry, like the reward functions (workbench/rollout/rewards.py). A task is one of
- a built-in on the run's own data (workbench/evals/builtin.py): `loss` (SFT), `preference`
  (DPO), `reward` (GRPO), each on the held-out split `data.eval_split`, and `generate`
  (completions of `eval.prompts` for the report);
- the embedded arithmetic tasks: `arith_add2`, `arith_add3`, `arith_mul1` (held-out exact-match
  accuracy, greedy, answer-only prompt; data_recipes/data/arith_<task>_eval.jsonl) and
  `arith_pref` (share of held-out pairs whose chosen completion has the higher log-prob),
  `arith_rm` (a reward model's accuracy on the same pairs: chosen scored above rejected),
  all on the test split; `arith_add2_val`, `arith_add3_val`, `arith_mul1_val`, `arith_pref_val` are
  the same on the validation split that settings are chosen on (workbench/data/arith.py);
- `needle` / `needle_val`: the long-context retrieval task's exact match, test and validation
  (a 4-digit code stated once in 1,600-3,300 tokens; workbench/data/needle.py), and `found`,
  the share of completions that hold the right code anywhere (an answer given in a sentence);
- `env`: greedy episodes with the run's environment on its held-out rows (`env.eval_path`):
  accuracy, the share of final answers that follow a tool result, turns (workbench/evals/episodes.py);
- `lm_eval:<task>` or `lm_eval:<task.yaml>`: an lm-evaluation-harness task, in-process on the
  model in memory (workbench/evals/lm_eval_task.py; the optional extra `.[eval]`);
- `package.module:function`, your own: called as `function(ctx)` with an `EvalContext`
  (ctx.model, ctx.tokenizer, ctx.generate(prompts) -> texts, ctx.step, ctx.tag, ctx.cfg) and
  returning {metric: number}. Its metrics are logged as `eval/<task>/<metric>` to metrics.jsonl,
  results.json and the report (where an accuracy with an `n` beside it also gets its Wilson 95%
  interval, `eval/<task>/accuracy_ci95: [lo, hi]`: workbench/evals/stats.py). A hook that raises
  stops the run with one line naming the hook and the step; the runner keeps the step's checkpoint first.

Every name is checked by preflight (`check_tasks`) before any weights load; `metrics` says which
`<task>/<metric>` names the tasks report, for preflight to check train.keep_best against.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.core.errors import UserError
from workbench.core.imports import user_function
from workbench.core.limits import UserCodeTimeout, call_with_limit
from workbench.data import arith
from workbench.data.preference import pairs_from_rows
from workbench.data.recipes import RECIPES_DIR
from workbench.evals import builtin, episodes, lm_eval_task
from workbench.methods.logps import preference_accuracy
from workbench.methods.rm import pair_rewards
from workbench.rollout import episodes as episode_rollouts
from workbench.rollout.generate import generate

ARITH = ("arith_add2", "arith_add3", "arith_mul1", "arith_pref", "arith_rm",
         "arith_add2_val", "arith_add3_val", "arith_mul1_val", "arith_pref_val")
LONG = ("needle", "needle_val")  # the long-context retrieval task (workbench/data/needle.py), exact match
TASKS = ARITH + LONG + ("loss", "preference", "reward", "reward_accuracy", "generate", "env")

# What each task reports (`eval/<task>/<metric>`; run() adds `seconds` to every task). A task may
# leave one out (`preference` without a reference reports no `accuracy`), never add another;
# `reward` adds one metric per reward function, and `env` the episode summary.
METRICS = {
    "loss": ("loss", "perplexity", "tokens", "n"),
    # paired rows; KTO's unpaired ones report desirable_reward / undesirable_reward instead
    "preference": ("accuracy", "margin", "chosen_reward", "rejected_reward", "desirable_reward",
                   "undesirable_reward", "logp_accuracy", "n"),
    "reward": ("mean", "n"),
    "reward_accuracy": ("accuracy", "margin", "chosen_reward", "rejected_reward", "n"),
    "generate": ("n", "mean_tokens"),
    "env": ("accuracy", "reward", "n"),
    "arith_rm": ("accuracy", "margin", "n"),
    **{t: ("accuracy", "n") for t in ARITH if t != "arith_rm"},
    # found: the right code anywhere in the completion as a number of its own, so a model that
    # answers in a sentence ("The access code of Station X is 9636.") is told apart from one that
    # cannot find the code (give it eval.max_new_tokens=24 to finish the sentence)
    **{t: ("accuracy", "found", "n") for t in LONG},
}


class EvalHookError(UserError):
    """A task raised while evaluating; names the task and the step."""


@dataclass
class EvalContext:
    """What a task sees. `cache` lives for the whole run (held-out rows are tokenised once)."""

    model: Any
    tokenizer: Any
    contract: Any
    eval_cfg: Any
    cfg: Any = None  # the whole validated run config (None when called outside a run)
    autocast: Any = None
    step: int = 0
    tag: str = "end"  # start | step | end
    run_dir: Path | None = None
    cache: dict = field(default_factory=dict)

    def autocast_ctx(self):
        return self.autocast or contextlib.nullcontext()

    def cached(self, key: str, make: Callable):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def generate_ids(self, conversations: list[list[dict]], max_new_tokens: int) -> list[list[int]]:
        return generate(self.model, self.tokenizer, conversations, max_new_tokens, self.contract.end_of_turn_id,
                        autocast=self.autocast)

    def generate(self, prompts: list, max_new_tokens: int | None = None) -> list[str]:
        """Greedy completions (text) of prompts given as strings or message lists."""
        convs = [[{"role": "user", "content": p}] if isinstance(p, str) else list(p) for p in prompts]
        ids = self.generate_ids(convs, max_new_tokens or self.eval_cfg.max_new_tokens)
        return [self.tokenizer.decode(x, skip_special_tokens=True) for x in ids]


def lookup(task: str) -> Callable:
    """The function behind a task name; UserError naming the choices when there is none."""

    if task in builtin.TASKS:
        return builtin.TASKS[task]
    if lm_eval_task.is_lm_eval(task):
        return lambda ctx: lm_eval_task.run(ctx, task)
    if task in ARITH or task in LONG:
        return lambda ctx: _arith(ctx, task)
    if task == "env":  # greedy episodes with the run's environment (workbench/evals/episodes.py)

        return episodes.run
    if ":" not in task:
        raise UserError(f"eval.tasks: unknown task {task!r}; built-ins are {list(TASKS)}, or name your own "
                        "hook as 'package.module:function'")

    return user_function(task, "eval.tasks")


def eval_rows(task: str, n: int) -> list[dict]:
    name = f"{task[:-4]}_validation" if task.endswith("_val") else f"{task}_eval"
    path = RECIPES_DIR / "data" / f"{name}.jsonl"
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return rows[:n]


def check_tasks(tasks, cfg=None) -> None:
    """Preflight: every task exists (user hooks import) and, given the run config, fits the run."""

    for t in tasks:
        if lm_eval_task.is_lm_eval(t):
            lm_eval_task.check(t)  # installed, task file readable
            continue
        lookup(t)
        if cfg is not None and t in builtin.TASKS:
            builtin.check(t, cfg)
        if cfg is not None and t == "env":

            episodes.check(cfg)


def key_name(task: str) -> str:
    """The `<task>` of the metric keys a task reports: lm_eval:<anything> -> lm_eval, a hook
    package.module:function -> function, a built-in -> itself."""
    if task.startswith("lm_eval:"):
        return "lm_eval"
    return task.rsplit(":", 1)[-1] if ":" in task else task


def metrics(tasks, cfg=None) -> dict[str, tuple[str, ...] | None]:
    """The metric names each task reports, by its key name (`key_name`): {"loss": ("loss", ...)}.
    None for a task whose metrics are known only when it runs (your own hook, lm_eval)."""
    out: dict[str, tuple[str, ...] | None] = {}
    for task in tasks:
        known = METRICS.get(task)
        if known is None:
            out[key_name(task)] = None
            continue
        if task == "reward":  # one mean per reward function, by its name (rewards.score)
            spec = cfg.get("reward") if cfg is not None else None
            fns = spec.get("functions") if hasattr(spec, "get") else spec
            known += tuple(str(f if isinstance(f, str) else f.get("name")) for f in fns or ())
        if task == "env":
            known += tuple(k.split("/", 1)[1] for k in episode_rollouts.summary([]))
        out[key_name(task)] = (*known, "seconds")
    return out


def exact_match(model, tokenizer, contract, task: str, cfg_eval, autocast=None) -> dict:
    rows = eval_rows(task, cfg_eval.num_samples)
    correct, found, samples = 0, 0, []
    for i in range(0, len(rows), cfg_eval.batch_size):
        chunk = rows[i:i + cfg_eval.batch_size]
        outs = generate(model, tokenizer, [r["prompt"] for r in chunk], cfg_eval.max_new_tokens,
                        contract.end_of_turn_id, autocast=autocast)
        for r, ids in zip(chunk, outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            ok = arith.is_correct(text, r["answer"])
            correct += ok
            found += r["answer"] in re.findall(r"\d+", text)
            if len(samples) < 5:
                samples.append({"prompt": r["prompt"][-1]["content"], "completion": text, "answer": r["answer"],
                                "correct": ok})
    out = {f"eval/{task}/accuracy": correct / max(1, len(rows)), f"eval/{task}/n": len(rows),
           "samples": {task: samples}}
    if task in LONG:
        out[f"eval/{task}/found"] = found / max(1, len(rows))
    return out


def _arith(ctx: EvalContext, task: str) -> dict:
    if task in ("arith_pref", "arith_pref_val"):
        rows = eval_rows(task, ctx.eval_cfg.num_samples)
        return {"accuracy": preference_accuracy(ctx.model, ctx.tokenizer, ctx.contract, rows, autocast=ctx.autocast),
                "n": len(rows)}
    if task == "arith_rm":

        pairs = pairs_from_rows(eval_rows("arith_pref", ctx.eval_cfg.num_samples), ctx.tokenizer, ctx.contract)
        r = pair_rewards(ctx.model, pairs, ctx.tokenizer.pad_token_id, ctx.eval_cfg.batch_size, autocast=ctx.autocast)
        return {"accuracy": float((r[0] > r[1]).float().mean()), "margin": float((r[0] - r[1]).mean()), "n": len(pairs)}
    res = exact_match(ctx.model, ctx.tokenizer, ctx.contract, task, ctx.eval_cfg, ctx.autocast)
    out = {k.rsplit("/", 1)[-1]: v for k, v in res.items() if k != "samples"}
    out["_samples"] = res["samples"][task]
    return out


def run(model, tokenizer, contract, cfg_eval, autocast=None, *, cfg=None, step: int = 0, tag: str = "end",
        run_dir=None, cache: dict | None = None) -> dict:
    """Every task in eval.tasks: {"eval/<task>/<metric>": value, "samples": {...}, "generations": [...]}."""
    out: dict = {"samples": {}}
    ctx = EvalContext(model, tokenizer, contract, cfg_eval, cfg, autocast, step, tag, run_dir,
                      cache if cache is not None else {})
    for task in cfg_eval.tasks:
        fn = lookup(task)
        t0 = time.perf_counter()
        try:
            res = call_with_limit(lambda f=fn: f(ctx), {}, cfg_eval.get("timeout_s"),
                                  f"eval hook {task!r} at step {step} ({tag} of training)")
        except UserCodeTimeout as exc:
            raise EvalHookError(str(exc)) from None
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's hook fails in its own ways; name it and the step
            raise EvalHookError(f"eval hook {task!r} raised at step {step} ({tag} of training): "
                                f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(res, dict):
            raise EvalHookError(f"eval hook {task!r} returned {type(res).__name__} at step {step}; "
                                "expected a dict of {metric: number}")
        name = key_name(task)
        for key, value in res.items():
            if key == "_samples":
                out["samples"][name] = value
            elif key == "_generations":
                out["generations"] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"eval/{name}/{key}"] = float(value) if isinstance(value, float) else value
            else:
                raise EvalHookError(f"eval hook {task!r} returned a non-number for {key!r} at step {step}: "
                                    f"{value!r:.80}")
        out[f"eval/{name}/seconds"] = time.perf_counter() - t0
    return out


def metrics_row(res: dict, step: int, tag: str) -> dict:
    """The numeric eval metrics as one metrics.jsonl row (`eval` says which evaluation)."""
    return {"step": step, "eval": tag, **{k: v for k, v in res.items()
                                          if k.startswith("eval/") and isinstance(v, (int, float))},
            "time": time.time()}


def log_metrics(run_dir, res: dict, step: int, tag: str) -> None:
    with (Path(run_dir) / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(metrics_row(res, step, tag)) + "\n")
