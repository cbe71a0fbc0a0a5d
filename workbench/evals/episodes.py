"""eval.tasks=[env]: greedy episodes with the run's environment on its held-out rows.

    python -m workbench method=grpo env=calc                     # env=... makes [env] the default evaluation
    python -m workbench method=grpo env=calc eval.num_samples=100 eval.every_n_steps=20

The same episode loop as training (workbench/rollout/episodes.py), greedy, on the first
eval.num_samples rows of `env.eval_path` (a prompt-row file relative to data_recipes/, or an
absolute path). Metrics (`eval/env/...`):
- accuracy: the share of episodes the environment calls solved (`correct`; absent when the
  environment does not say);
- answer_after_tool: of the episodes that ended with a final answer, the share whose answer
  follows a tool result (did the model use the tool, or answer from its head);
- answered, turns, tool_calls, tool_errors, cut_max_turns: what the episodes did;
- reward: the mean total of the run's reward functions (and the environment's own reward).
A few whole episodes are kept as samples for the report.

This evaluation needs only a model with full weights (rank 0 evaluates the gathered model);
it also works on a model trained without an environment, e.g. the SFT warm start, when the
run's config has `env=` (scripts/agent_seeds.py evaluates so).
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.core.errors import UserError
from workbench.data.preference import messages
from workbench.data.recipes import RECIPES_DIR
from workbench.envs.base import check_node
from workbench.envs.registry import load
from workbench.rollout import episodes, rewards
from workbench.rollout.generate import generate_ids
from workbench.rollout.turns import Turns


def _path(node) -> Path:
    if not node.get("eval_path"):
        raise UserError("eval.tasks: 'env' needs held-out prompt rows: set env.eval_path (a jsonl of "
                        '{"prompt": [...], ...} rows, relative to data_recipes/)')
    p = Path(node["eval_path"])
    return p if p.is_absolute() else RECIPES_DIR / p


def check(cfg) -> None:
    """Preflight: an environment is chosen and its held-out rows exist."""
    if cfg.get("env") is None:
        raise UserError("eval.tasks: 'env' evaluates episodes of an environment; choose one (env=calc)")
    path = _path(check_node(cfg.env))
    if not path.exists():
        raise UserError(f"env.eval_path: {path} does not exist")


def rows(node, n: int) -> list[dict]:
    out = []
    path = _path(node)
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        where = f"{path}:{i + 1}"
        if "prompt" not in row:
            raise UserError(f"{where}: an env.eval_path row needs a 'prompt' (keys: {sorted(row)})")
        out.append({**row, "prompt": messages(row["prompt"], where, "prompt", "user"), "_where": where})
        if len(out) >= n:
            break
    return out


def run(ctx) -> dict:
    node = check_node(ctx.cfg.env)
    env = load(ctx.cfg.env)
    turns = Turns(ctx.tokenizer, ctx.contract, env.tools, node["tool_format"])
    held = ctx.cached("env/rows", lambda: rows(node, ctx.eval_cfg.num_samples))
    eot, pad = ctx.contract.end_of_turn_id, ctx.tokenizer.pad_token_id

    def sample(prompts, first):
        return generate_ids(ctx.model, prompts, node["max_new_tokens"], eot, pad, autocast=ctx.autocast)

    eps = []
    for i in range(0, len(held), ctx.eval_cfg.batch_size):
        eps += episodes.run(env, turns, held[i:i + ctx.eval_cfg.batch_size], sample,
                            max_new_tokens=node["max_new_tokens"], max_turns=node["max_turns"])
    out = {k.split("/", 1)[1]: v for k, v in episodes.summary(eps).items()}
    verdicts = [env.correct(e.state, e.messages) for e in eps]
    if all(v is not None for v in verdicts):
        out["accuracy"] = sum(map(bool, verdicts)) / max(1, len(eps))
    fns = rewards.resolve(ctx.cfg.reward) if ctx.cfg.get("reward") is not None else []
    if fns:
        import torch

        scores, _ = episodes.score(fns, eps, node["max_new_tokens"])
        out["reward"] = float((scores * torch.tensor([f.weight for f in fns])).sum(dim=1).mean())
    out["n"] = len(eps)
    out["_samples"] = [_sample(e, v) for e, v in zip(eps[:5], verdicts[:5])]
    return out


def _sample(ep, verdict) -> dict:
    """One episode for the report: the question, then the turns after it on one line."""
    turns = [m["content"] if m["role"] == "assistant" else f"[{m.get('name', m['role'])}: {m['content']}]"
             for m in ep.messages[ep.opening:]]
    out = {"prompt": ep.row["prompt"][-1]["content"], "completion": " -> ".join(turns) + (f" (cut: {ep.cut})" if ep.cut else "")}
    if verdict is not None:
        out.update(correct=bool(verdict), answer=ep.row.get("answer", "?"))
    return out
