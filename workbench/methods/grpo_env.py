"""GRPO with an environment (`env=<name>`): each completion is an episode of several turns.

    python -m workbench method=grpo env=calc model.path=<warm start>/export/merged
    python -m workbench method=grpo env=calc method.async_rollouts=true    # generate the next step while this one trains

GRPO stays one method (workbench/methods/grpo.py): with `env` set its rollout makes
`num_generations` episodes per prompt row instead of single completions (workbench/rollout/
episodes.py: generate a turn with the current policy through the backend's generation context,
parse tool calls, step the environment, append the tool messages rendered by the chat template,
until the episode ends or env.max_turns). Each episode is one (ids, labels) sequence whose
labels mark the tokens the policy sampled; GRPO collates those like single completions (a row
per episode, or the episodes of one prompt as branches of one row with method.share_prompt),
so its log-probs, KL, importance ratios and clip fractions cover sampled tokens only.

Rewards: the run's reward functions (`reward=`, conf/reward/) score each episode with the
whole conversation (`conversations=`, the messages as the policy saw them, tool calls in the
HF `tool_calls` form), the environment's own reward (`env_reward=`, None where it gave none),
the final turn's text and ids (`completions=`, `completion_ids=`) and the prompt row's columns;
conf/env/calc.yaml picks reward=final_answer. `method.truncated_reward` stands in for the
reward of an episode cut at env.max_new_tokens or env.max_turns. Logged per step: `episode/*`
(turns, tool calls and errors, cut shares, the share of final answers that follow a tool
result, sampled and total tokens); a few whole episodes go to <run_dir>/samples/episodes.jsonl.
"""

from __future__ import annotations

import json
import sys

import torch

from workbench.compute import precision
from workbench.core import heartbeat
from workbench.core.secrets import redact, secret_values
from workbench.envs import base as envs
from workbench.envs import registry as env_registry
from workbench.rollout import advantages, episodes
from workbench.rollout.generate import generate_ids
from workbench.rollout.turns import Turns


class EpisodeRollouts:
    def __init__(self, grpo):
        ctx = grpo.ctx
        self.node = envs.check_node(ctx.cfg.env)
        self.env = env_registry.load(ctx.cfg.env)
        self.turn_tokens = int(self.node["max_new_tokens"])
        self.max_turns = int(self.node["max_turns"])
        self.turns = Turns(ctx.tokenizer, ctx.contract, self.env.tools, self.node["tool_format"])
        note = self.turns.check()  # the chat contract across turns: UserError, or a note
        if ctx.run.layout.is_main:
            print(self.describe() + (f"; note: {note}" if note else ""), file=sys.stderr)

    def describe(self) -> str:
        t = self.turns
        return (f"episodes: env={self.node['name']}, at most {self.max_turns} turns x {self.turn_tokens} new tokens, "
                f"tool calls in the {t.format.family} format, tools declared "
                f"{'by the chat template' if t.native_tools else 'in a system message'}, results as "
                f"{'tool' if t.tool_role == 'tool' else 'user (the template has no tool role)'} messages")

    @property
    def budget(self) -> int:
        """Sampled tokens an episode may have at most (dr_grpo's normaliser)."""
        return self.turn_tokens * self.max_turns

    def sampler(self, model, temperature: float, top_p: float, autocast, synced: bool, passes: list | None,
                do_sample: bool = True):
        tok, eot = self.turns.tok, self.turns.contract.end_of_turn_id

        def sample(prompts: list[list[int]], first: bool) -> list[list[int]]:
            # identical prompts share their prefill on the first turn; later turns differ per episode,
            # and under synced generation every rank must take the same path (the same forwards)
            return generate_ids(model, prompts, self.turn_tokens, eot, tok.pad_token_id, do_sample=do_sample,
                                temperature=temperature, top_p=top_p, autocast=autocast, synced=synced,
                                dedup=first or not synced, passes=passes)

        return sample

    def vllm_sampler(self, engine, temperature: float, top_p: float):
        def sample(prompts: list[list[int]], first: bool) -> list[list[int]]:
            return engine.generate_ids(prompts, self.turn_tokens, temperature, top_p)

        return sample

    def groups(self, grpo, backend, rows: list[dict]) -> list[dict]:
        """num_generations episodes per prompt row, scored: one record per group, as GRPO's _groups."""
        c, G, ctx = grpo.cfg, grpo.cfg.num_generations, grpo.ctx
        if grpo.engine is not None:
            grpo.engine.sync_weights(backend.unwrapped().inner)
            grpo.engine.wake()
            try:
                with heartbeat.phase("rollout"):
                    eps = episodes.run(self.env, self.turns, rows, self.vllm_sampler(grpo.engine, c.temperature, c.top_p),
                                       repeat=G, max_new_tokens=self.turn_tokens, max_turns=self.max_turns)
            finally:
                grpo.engine.sleep()
        else:
            with backend.generation() as (model, synced), heartbeat.phase("rollout"):
                sample = self.sampler(model, c.temperature, c.top_p, precision.autocast(ctx.run.precision, ctx.device),
                                      synced, grpo._passes)
                eps = episodes.run(self.env, self.turns, rows, sample, repeat=G, max_new_tokens=self.turn_tokens,
                                   max_turns=self.max_turns, synced=synced)
        total, per_fn, texts = self.score(grpo.reward_fns, eps, grpo._step, grpo.reward_timeout, c.truncated_reward)
        self._write(grpo, eps, total)
        out = []
        for i, row in enumerate(rows):
            mine = eps[i * G:(i + 1) * G]
            t = total[i * G:(i + 1) * G]
            out.append({"conv": row["prompt"], "comp": [e.last_ids for e in mine], "texts": texts[i * G:(i + 1) * G],
                        "per_fn": per_fn[i * G:(i + 1) * G], "total": t, "signal": advantages.has_signal(t),
                        "seqs": [(e.ids, e.labels) for e in mine], "episodes": mine})
        return out

    def score(self, fns, eps: list, step: int | None, limit_s: float | None, truncated_reward: float | None):
        """(total, per-function rewards, final-turn texts) of the episodes."""
        per_fn, texts = episodes.score(fns, eps, self.turn_tokens, step, limit_s)
        total = (per_fn * torch.tensor([f.weight for f in fns])).sum(dim=1)
        if truncated_reward is not None:
            cut = torch.tensor([e.cut is not None for e in eps])
            total = torch.where(cut, torch.tensor(float(truncated_reward)), total)
        return total, per_fn, texts

    def info(self, groups: list[dict]) -> dict:
        return episodes.summary([e for g in groups for e in g["episodes"]])

    def _write(self, grpo, eps: list, total) -> None:
        n = grpo.cfg.log_completions
        if not grpo.ctx.run.layout.is_main or not n:
            return
        path = grpo.ctx.run_dir / "samples" / "episodes.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        secrets = secret_values(grpo.ctx.cfg)  # prompts, tool results: the one rule (workbench/core/secrets.py)
        with path.open("a") as fh:
            for e, r in list(zip(eps, total.tolist()))[:n]:
                fh.write(json.dumps(redact({"step": grpo._step, "messages": e.messages, "reward": r, "cut": e.cut,
                                            "sampled_tokens": e.sampled}, secrets), default=str) + "\n")
