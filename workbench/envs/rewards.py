"""Reward functions that read a whole episode (GRPO with `env=`): registered in workbench/rollout/rewards.py.

    python -m workbench method=grpo env=calc                  # conf/env/calc.yaml picks reward=final_answer
    python -m workbench method=grpo env=mypkg:Shop reward=env  # the environment's own reward

With an environment every reward function is also given `conversations` (each episode's
messages: the prompt, the assistant turns, tool calls in the HF `tool_calls` form, the tool
results) and `env_reward` (what the environment returned when the episode ended, or None).
"""

from __future__ import annotations

from workbench.envs.base import final_answer as _final

NEEDS_ENV = ("final_answer", "env")  # reward names that only an episode can feed (rule env-rewards-need-env)


def final_answer(conversations, answer, **_) -> list[float]:
    """1.0 when the episode's final answer (its last turn, finished and without a tool call) is
    exactly the row's `answer`, else 0.0; an episode cut while still calling tools scores 0."""
    return [float(_final(c) == str(a).strip()) for c, a in zip(conversations, answer)]


def env(env_reward, **_) -> list[float]:
    """The environment's own reward for each episode (0.0 where it gave none)."""
    return [0.0 if r is None else float(r) for r in env_reward]
