"""The calculator task (env=calc): questions, held-out split and tool-use demonstrations.

    python scripts/make_data.py       # writes data_recipes/data/calc_*.jsonl from these functions

Two kinds of question a 135M model cannot answer in its head: 3-digit addition (100-999 +
100-999) and 2-digit multiplication (10-99 x 10-99), alternating. The split is deterministic
and by unordered operand pair, so a held-out `a * b` never appears as `b * a` in training:

- calc_eval.jsonl: 200 held-out prompt rows, the test split (`eval.tasks=[env]` reads the first
  eval.num_samples);
- calc_validation.jsonl: 100 held-out prompt rows to choose settings on (`env.eval_path=data/calc_validation.jsonl`);
- calc_grpo_train.jsonl: 2000 prompt rows {"prompt", "answer"} for GRPO episodes;
- calc_sft_train.jsonl: 1000 demonstrations for the SFT warm start, disjoint from both: the
  tools declared in a system message, the question, a `calc` call in the Hermes/Qwen format,
  the tool's result as a `tool` message, and the bare answer. The system message is the one
  the calculator environment shows a template without native tool rendering (SmolLM2's;
  workbench/rollout/turns.py), so the warm start is trained on what the episodes show it;
- calc_sft_direct.jsonl: the same 1000 questions under the same system message answered at once
  with the bare number, no call. data_recipes/calc_sft_mixed.yaml mixes one tool episode to three
  of these: a warm start that knows both the call format and the bare answer, and calls the
  tool in about a quarter of its sampled episodes, so GRPO's reward has both to compare (a warm
  start on tool episodes alone goes from never calling within 10 LoRA steps to calling in most
  greedy episodes by 16, leaving GRPO little between).
"""

from __future__ import annotations

import random

from workbench.data.arith import INSTRUCTION, answer
from workbench.envs.calculator import TOOL, evaluate
from workbench.envs.tools import Hermes, ToolCall, describe

KINDS = {"add3": ((100, 999), "+"), "mul2": ((10, 99), "*")}
N_EVAL, N_GRPO, N_SFT, N_VAL = 100, 1000, 500, 50  # per kind


def question(a: int, b: int, op: str) -> str:
    return f"What is {a} {op} {b}? {INSTRUCTION}"


def _pairs(kind: str) -> list[tuple[int, int]]:
    """Every unordered operand pair of the kind, in a fixed random order and orientation."""
    (lo, hi), _ = KINDS[kind]
    rng = random.Random(f"calc-{kind}")
    if kind == "add3":  # 405k unordered pairs: sample enough, deterministically
        seen: set = set()
        while len(seen) < 4 * (N_EVAL + N_GRPO + N_SFT):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            seen.add((min(a, b), max(a, b)))
        pairs = sorted(seen)
    else:
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]
    rng.shuffle(pairs)
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pairs]


def splits() -> dict[str, list[tuple[int, int, str]]]:
    """{"eval", "grpo", "sft", "validation"}: (a, b, op) triples, the two kinds alternating, never shared.

    Validation comes after the others in each kind's order, so adding it left them as they were."""
    out: dict[str, list] = {"eval": [], "grpo": [], "sft": [], "validation": []}
    per_kind = {}
    for kind in KINDS:
        p = _pairs(kind)
        per_kind[kind] = {"eval": p[:N_EVAL], "grpo": p[N_EVAL:N_EVAL + N_GRPO],
                          "sft": p[N_EVAL + N_GRPO:N_EVAL + N_GRPO + N_SFT],
                          "validation": p[N_EVAL + N_GRPO + N_SFT:N_EVAL + N_GRPO + N_SFT + N_VAL]}
    for name in out:
        for add, mul in zip(per_kind["add3"][name], per_kind["mul2"][name]):
            out[name] += [(*add, "+"), (*mul, "*")]
    return out


def prompt_row(a: int, b: int, op: str) -> dict:
    return {"prompt": [{"role": "user", "content": question(a, b, op)}], "answer": answer(a, b, op)}


def demonstration(a: int, b: int, op: str) -> dict:
    """One tool-use episode as SFT messages: call calc, read its result, answer."""
    fmt = Hermes()
    expression = f"{a} {op} {b}"
    result = evaluate(expression)
    return {"messages": [
        *_asked(a, b, op),
        {"role": "assistant", "content": fmt.render(ToolCall("calc", {"expression": expression}))},
        {"role": "tool", "name": "calc", "content": result},
        {"role": "assistant", "content": result},
    ]}


def direct_answer(a: int, b: int, op: str) -> dict:
    """The same question answered at once with the bare number, no tool call."""
    return {"messages": [*_asked(a, b, op), {"role": "assistant", "content": answer(a, b, op)}]}


def _asked(a: int, b: int, op: str) -> list[dict]:
    """The tools as the environment shows them to SmolLM2, then the question."""
    return [{"role": "system", "content": describe([TOOL], Hermes())}, {"role": "user", "content": question(a, b, op)}]


def files() -> dict[str, list[dict]]:
    s = splits()
    return {"calc_eval.jsonl": [prompt_row(*t) for t in s["eval"]],
            "calc_validation.jsonl": [prompt_row(*t) for t in s["validation"]],
            "calc_grpo_train.jsonl": [prompt_row(*t) for t in s["grpo"]],
            "calc_sft_train.jsonl": [demonstration(*t) for t in s["sft"]],
            "calc_sft_direct.jsonl": [direct_answer(*t) for t in s["sft"]]}
