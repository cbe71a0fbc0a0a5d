"""Reward functions for GRPO: a registry of built-ins plus any `module:function` the user names.

    python -m workbench method=grpo reward=arith_exact        # conf/reward/arith_exact.yaml
    python -m workbench method=grpo                           # reward=arith_digits: exact match + digit credit
    python -m workbench method=grpo reward=arith_format       # exact match + format, weighted
    python -m workbench method=grpo reward=model reward.path=runs/<rm run>   # a trained reward model
    python -m workbench method=grpo reward=http reward.url=http://127.0.0.1:8000   # a reward server
    python -m workbench method=grpo reward=judge reward.base_url=http://127.0.0.1:8080/v1 reward.model=judge

The `reward` config node is `{functions: [{name: arith_exact, weight: 1.0}, "format", ...]}`.
Every function is called once per generation batch as

    fn(prompts=[messages...], completions=[str...], completion_ids=[[int...]...], **columns) -> [float...]

where `columns` are the prompt rows' other fields (e.g. `answer`), one list entry per
completion. The name `model` is a trained reward model (workbench/rollout/reward_model.py), read
from the node's `path`; the name `http` is a reward server (workbench/rollout/remote.py), read
from the node's `url` and its other fields, asked whether it is up before any weights load
(check_columns) and named with its URL, status and body when it fails; the name `judge` is a
judge model behind an OpenAI-compatible chat endpoint (workbench/rollout/judge.py), read from the
node's `base_url`, `model`, `rubric` and the same HTTP settings, its rubric's fields checked on
every prompt row like a function's required parameters. A function that raises,
returns the wrong number of values, or returns NaN / None stops the run with one line naming the
function and the sample. A parameter a function requires (no default) that only a prompt row can
give (e.g. `answer`) is checked on every prompt row before any weights load (check_columns), so a
row without it stops the run at once, with its file:line.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workbench.core import heartbeat
from workbench.core.errors import UserError
from workbench.core.imports import user_function
from workbench.core.limits import UserCodeTimeout, call_with_limit
from workbench.data import arith
from workbench.envs import rewards as episode_rewards
from workbench.rollout.judge import JudgeReward
from workbench.rollout.remote import HttpReward, RewardServiceError
from workbench.rollout.reward_model import ModelReward

_NUMBER = re.compile(r"-?\d+")


def arith_exact(completions, answer, **_) -> list[float]:
    """1.0 when the completion is exactly the expected number (arith.is_correct), else 0.0."""
    return [float(arith.is_correct(c, str(a))) for c, a in zip(completions, answer)]


def arith_close(completions, answer, **_) -> list[float]:
    """Partial credit that needs the right magnitude: for a bare integer x, max(0, 1 - |x - a| / |a|)
    against the expected number a (1.0 when exact, 0.5 when half the answer away); 0.0 for
    anything else. A bare number of the wrong size earns about nothing, so a policy cannot settle
    on one-digit answers for a format bonus (reward=arith_format can: docs/measurements/learning.md)."""
    out = []
    for c, a in zip(completions, answer):
        c, a = c.strip(), int(a)
        out.append(max(0.0, 1.0 - abs(int(c) - a) / max(abs(a), 1)) if _NUMBER.fullmatch(c) else 0.0)
    return out


def arith_digits(completions, answer, **_) -> list[float]:
    """Partial credit digit by digit: for a bare integer with as many digits as the expected
    number, the share of its digits that equal the answer's, position by position (1.0 when
    exact); 0.0 for anything else. A number of the wrong length earns nothing, so a policy cannot
    settle on one-digit answers for a format bonus, and every right digit is worth the same
    (GRPO's default with arith_exact, conf/reward/arith_digits.yaml; docs/measurements/learning.md)."""
    out = []
    for c, a in zip(completions, answer):
        c, a = c.strip(), str(int(a))
        right = _NUMBER.fullmatch(c) and len(c) == len(a)
        out.append(sum(x == y for x, y in zip(c, a)) / len(a) if right else 0.0)
    return out


def number_format(completions, **_) -> list[float]:
    """1.0 when the completion is a bare integer and nothing else, else 0.0."""
    return [float(bool(_NUMBER.fullmatch(c.strip()))) for c in completions]


def length(completion_ids, max_new_tokens=None, **_) -> list[float]:
    """Shorter is better: 1 - tokens / max_new_tokens (or -tokens when the budget is unknown)."""
    if max_new_tokens:
        return [1.0 - len(ids) / max_new_tokens for ids in completion_ids]
    return [-float(len(ids)) for ids in completion_ids]


def digits(completions, **_) -> list[float]:
    """Share of the completion's non-space characters that are digits (partial credit toward a bare number)."""
    out = []
    for c in completions:
        chars = [ch for ch in c if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


REGISTRY: dict[str, Callable] = {"arith_exact": arith_exact, "arith_digits": arith_digits, "arith_close": arith_close,
                                 "format": number_format, "length": length, "digits": digits}
REGISTRY.update({"final_answer": episode_rewards.final_answer, "env": episode_rewards.env})  # whole episodes (env=)


@dataclass
class RewardFn:
    name: str
    fn: Callable
    weight: float


def _lookup(name: str, spec) -> Callable:
    if name == "model":  # a reward model directory, checked now; its weights load at the first call

        return ModelReward.from_spec(spec)
    if name == "http":  # a reward server: the node's url, timeouts and headers, checked now; asked at check_columns
        return HttpReward.from_spec(spec)
    if name == "judge":  # a judge model: the node's base_url, model, rubric and scoring, checked now
        return JudgeReward.from_spec(spec)
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" not in name:
        raise UserError(f"reward: unknown reward function {name!r}; built-ins are {sorted(REGISTRY)}, 'model' and 'http' "
                        "and 'judge' (reward nodes), or name your own as 'package.module:function'")

    return user_function(name, "reward")


def resolve(spec) -> list[RewardFn]:
    """Reward functions and weights from the `reward` config node; UserError when there are none."""
    if spec is None:
        raise UserError("method=grpo needs a reward: add e.g. reward=arith_exact (see conf/reward/)")
    functions = spec.get("functions") if hasattr(spec, "get") else spec
    if not functions:
        raise UserError("reward.functions is empty: method=grpo needs at least one reward function")
    out = []
    for i, item in enumerate(functions):
        if isinstance(item, str):
            name, weight = item, 1.0
        elif hasattr(item, "get") and item.get("name"):
            name, weight = str(item["name"]), item.get("weight", 1.0)
        else:
            raise UserError(f"reward.functions[{i}]: expected a name or {{name, weight}}, got {item!r}")
        try:
            weight = float(weight)
        except (TypeError, ValueError):
            raise UserError(f"reward.functions[{i}].weight: not a number: {weight!r}") from None
        out.append(RewardFn(name, _lookup(name, spec), weight))
    return out


# what score() hands every function besides the prompt rows' columns
GIVEN = frozenset({"prompts", "completions", "completion_ids", "max_new_tokens", "conversations", "env_reward"})


def required_columns(fn) -> set[str]:
    """The parameters `fn` requires (no default) that only a prompt row's columns can give; for a
    reward server, the fields its health check named (`needs_columns`, known after check_services)."""
    declared = getattr(fn, "needs_columns", None)
    if declared is not None:
        return set(declared)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: found out at its first call
        return set()
    return {p.name for p in params if p.default is p.empty and p.name not in GIVEN
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_services(fns: list[RewardFn]) -> None:
    """Every reward service answers its health check (reward=http: workbench/rollout/remote.py;
    reward=judge: workbench/rollout/judge.py);
    a service that is down stops the run here, in one line."""
    for rf in fns:
        check = getattr(rf.fn, "check_service", None)
        if callable(check):
            check()


def check_columns(fns: list[RewardFn], rows) -> None:
    """Before weights load: every reward service is up (check_services), and every (where, row)
    carries the columns each reward function requires."""
    check_services(fns)
    needs = {rf.name: cols for rf in fns if (cols := required_columns(rf.fn))}
    if not needs:
        return
    for where, row in rows:
        for name, cols in needs.items():
            missing = sorted(cols - set(row))
            if missing:
                raise UserError(f"{where}: reward function {name!r} needs the column(s) {missing}, which this "
                                f"prompt row does not have (keys: {sorted(k for k in row if k != '_where')}); "
                                "add them to every row or choose another reward")


def _describe(prompts, completions, i: int) -> str:
    prompt = prompts[i][-1]["content"] if prompts[i] else ""
    return f"sample {i} (prompt {prompt[:60]!r}, completion {completions[i][:60]!r})"


# reward.timeout_s for a reward node without one (each conf/reward/*.yaml sets it): a reward
# model scoring a batch on a CPU takes seconds; a function silent for five minutes is stuck
TIMEOUT_S = 300.0


def score(fns: list[RewardFn], prompts, completions, completion_ids, columns: dict, *, step: int | None = None,
          limit_s: float | None = None, **extra) -> torch.Tensor:
    """Per-function rewards, shape (completions, functions), checked. Each function runs with
    `limit_s` seconds (reward.timeout_s) and marks its phase for the watchdog."""
    n = len(completions)
    at = f" at step {step + 1}" if step is not None else ""
    cols = []
    for rf in fns:
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns, **extra)
        what = (f"reward function {rf.name!r}{at} on {n} completions (the first for {_describe(prompts, completions, 0)})"
                if n else f"reward function {rf.name!r}{at}")
        try:
            with heartbeat.phase("reward function", rf.name):
                values = call_with_limit(rf.fn, kwargs, limit_s, what)
        except UserCodeTimeout:
            raise
        except RewardServiceError as exc:  # named in full by the client; a service is not asked sample by sample
            raise RewardServiceError(f"reward function {rf.name!r}{at}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - find which sample a user's function fails on
            bad = next((i for i in range(n) if _fails(rf.fn, kwargs, i)), None)
            where = _describe(prompts, completions, bad) if bad is not None else "a batch"
            raise UserError(f"reward function {rf.name!r} raised{at} on {where}: {type(exc).__name__}: {exc}") from None
        try:
            values = [float("nan") if v is None else float(v) for v in values]
        except (TypeError, ValueError):
            raise UserError(f"reward function {rf.name!r} returned non-numbers: {values!r:.200}") from None
        if len(values) != n:
            raise UserError(f"reward function {rf.name!r} returned {len(values)} values for {n} completions")
        nan = next((i for i, v in enumerate(values) if math.isnan(v) or math.isinf(v)), None)
        if nan is not None:
            raise UserError(f"reward function {rf.name!r} returned {values[nan]} for "
                            f"{_describe(prompts, completions, nan)}")
        cols.append(values)
    return torch.tensor(cols, dtype=torch.float32).T.reshape(n, len(fns))


def _fails(fn, kwargs: dict, i: int) -> bool:
    one = {k: (v[i:i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}
    try:
        fn(**one)
    except Exception:  # noqa: BLE001
        return True
    return False
