"""The episode loop: multi-turn rollouts with an environment, and which tokens the policy sampled.

    eps = run(env, turns, rows, sample, repeat=G, max_new_tokens=48, synced=False)
    ids, labels = eps[0].ids, eps[0].labels     # labels: the token where the policy sampled it, else IGNORE

Each turn, every episode still running asks the policy for one assistant turn (`sample`: token
ids in, sampled ids out, end-of-turn stripped, as workbench/rollout/generate.py returns them),
the turn is parsed for tool calls by the chat template's format (workbench/envs/tools.py),
and the environment (workbench/envs/base.py) answers it: tool results and/or messages, which
are appended as context tokens rendered by the template (workbench/rollout/turns.py), or the
end of the episode. An episode also ends when a turn is cut at max_new_tokens (nothing to
answer: it did not finish) or after env.max_turns turns (`cut`).

The token sequence is built as the turns happen and never re-tokenised, so what a turn was
sampled after is exactly what it is trained after. `labels` mark the sampled tokens: each
assistant turn's tokens and the end-of-turn token that ended it (the policy sampled that too;
generation stopped on it). The prompt, tool results, user messages and the template's own text
between turns (newlines, headers) are IGNORE: the model reads them but they enter no log-prob,
KL or importance ratio (GRPO's `select`/`targets` come from these labels).

Ranks: under sharded weights (FSDP2, ZeRO-3) every forward is a collective, so `synced=True`
makes every rank take part in every turn's generation as long as any rank has an episode
running (a rank whose episodes have all ended generates for a stand-in row and discards it),
and generation itself keeps stepping until every rank's rows have stopped (HF synced_gpus).
Every rank therefore runs the same number of turns and no rank waits in a collective the
others never join, however long each rank's episodes are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.data.chat import IGNORE
from workbench.envs.base import Turn, answered_after_tool, final_answer
from workbench.rollout import rewards
from workbench.train.distributed import all_max

# (token ids of each running episode, first turn?) -> one sampled turn per episode
Sampler = Callable[[list[list[int]], bool], list[list[int]]]


@dataclass
class Episode:
    row: dict
    state: object
    messages: list[dict]
    ids: list[int]
    labels: list[int]
    prompt_len: int
    turns: int = 0
    done: bool = False
    cut: str | None = None  # None | "max_turns" | "max_new_tokens"
    reward: float | None = None  # the environment's own, when it gave one
    tool_calls: int = 0
    tool_errors: int = 0
    last_ids: list[int] = field(default_factory=list)  # the last turn's sampled ids, end-of-turn stripped
    spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each sampled turn in ids
    opening: int = 0  # messages before the first assistant turn (the prompt, tools declared)

    @property
    def final(self) -> str | None:
        return final_answer(self.messages)

    @property
    def after_tool(self) -> bool:
        return answered_after_tool(self.messages)

    @property
    def sampled(self) -> int:
        return sum(1 for y in self.labels if y != IGNORE)


def start(env, turns, row: dict) -> Episode:
    state = env.reset(row)
    try:
        messages = turns.start(env.prompt(state, row["prompt"]))
        ids = turns.prompt_ids(messages)
    except BaseException:
        env.end(state)
        raise
    return Episode(row, state, messages, list(ids), [IGNORE] * len(ids), len(ids), opening=len(messages))


def advance(env, turns, ep: Episode, ids: list[int], max_new_tokens: int, max_turns: int) -> None:
    """Append one sampled turn to `ep` and let the environment answer it."""
    stopped = len(ids) < max_new_tokens  # generate strips the end-of-turn: one that ended is shorter
    sampled = ids + ([turns.contract.end_of_turn_id] if stopped else [])
    ep.spans.append((len(ep.ids), len(ep.ids) + len(sampled)))
    ep.ids += sampled
    ep.labels += sampled
    ep.turns += 1
    ep.last_ids = list(ids)
    text = turns.tok.decode(ids, skip_special_tokens=False)
    calls, errors = turns.format.parse(text)
    message = {"role": "assistant", "content": text}
    if calls:  # the HF convention, so reward functions and final_answer see the call
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    if errors:
        message["tool_call_errors"] = list(errors)
    if not stopped:
        message["truncated"] = True
    ep.messages.append(message)
    ep.tool_calls += len(calls)
    if not stopped:
        ep.done, ep.cut = True, "max_new_tokens"
        return
    if ep.turns >= max_turns and (calls or errors):
        ep.done, ep.cut = True, "max_turns"  # its results would come after the last turn it may take
        return
    reply = env.step(ep.state, Turn(text, calls, errors, ep.messages))
    if reply.done:
        ep.done, ep.reward = True, reply.reward
        return
    if ep.turns >= max_turns:
        ep.done, ep.cut = True, "max_turns"
        return
    new = [turns.tool_message(r.name, r.content) for r in reply.results] + list(reply.messages)
    if not new:
        raise RuntimeError(f"environment {type(env).__name__} neither ended the episode nor answered the turn")
    ep.tool_errors += sum(r.error for r in reply.results)
    ep.messages += new
    context = turns.context_ids(new)
    ep.ids += context
    ep.labels += [IGNORE] * len(context)


def run(env, turns, rows: list[dict], sample: Sampler, repeat: int = 1, max_new_tokens: int = 64,
        max_turns: int | None = None, synced: bool = False) -> list[Episode]:
    """`repeat` episodes per row (row i's at [i*repeat, (i+1)*repeat)), run to their end."""
    max_turns = max_turns or env.max_turns
    episodes = []
    try:
        for row in rows:
            for _ in range(repeat):
                episodes.append(start(env, turns, row))
        for turn in range(max_turns):
            active = [e for e in episodes if not e.done]
            if (all_max(len(active)) if synced else len(active)) == 0:
                break
            # a rank with nothing left still joins the collective forwards of this turn
            prompts = [e.ids for e in active] or [episodes[0].ids[:episodes[0].prompt_len]]
            outs = sample(prompts, turn == 0)
            for ep, ids in zip(active, outs):
                advance(env, turns, ep, ids, max_new_tokens, max_turns)
    finally:  # every episode's end, however the rollout ended (an environment server's sessions close)
        for ep in episodes:
            env.end(ep.state)
    return episodes


def score(fns, episodes: list[Episode], max_new_tokens: int, step: int | None = None, limit_s: float | None = None):
    """(per-function rewards (episodes x functions), final-turn texts): each reward function sees
    the whole conversation (`conversations`), the environment's own reward (`env_reward`), the
    final turn (`completions`, `completion_ids`) and the prompt rows' columns."""
    texts = [e.messages[-1]["content"] if e.messages[-1]["role"] == "assistant" else "" for e in episodes]
    cols = sorted({k for e in episodes for k in e.row if k not in ("prompt", "_where")})
    per_fn = rewards.score(fns, [e.row["prompt"] for e in episodes], texts, [e.last_ids for e in episodes],
                           {k: [e.row.get(k) for e in episodes] for k in cols}, step=step, limit_s=limit_s,
                           max_new_tokens=max_new_tokens, conversations=[e.messages for e in episodes],
                           env_reward=[e.reward for e in episodes])
    return per_fn, texts


def summary(episodes: list[Episode]) -> dict:
    """Per-step episode metrics (logged as `episode/*`)."""
    n = max(1, len(episodes))
    answered = [e for e in episodes if e.final is not None]
    return {"episode/turns": sum(e.turns for e in episodes) / n,
            "episode/tool_calls": sum(e.tool_calls for e in episodes) / n,
            "episode/tool_errors": sum(e.tool_errors for e in episodes) / n,
            "episode/cut_max_turns": sum(e.cut == "max_turns" for e in episodes) / n,
            "episode/cut_max_new_tokens": sum(e.cut == "max_new_tokens" for e in episodes) / n,
            "episode/answered": len(answered) / n,
            "episode/answer_after_tool": sum(e.after_tool for e in answered) / max(1, len(answered)),
            "episode/sampled_tokens": sum(e.sampled for e in episodes) / n,
            "episode/tokens": sum(len(e.ids) for e in episodes) / n}
