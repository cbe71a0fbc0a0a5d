"""A judge trained by the workbench: SmolLM2-135M taught to answer reward=judge's yes/no rubric
the way `arith_exact` scores, exported to GGUF for llama.cpp's server (docs/measurements/learning.md,
"A workbench-trained judge").

    .venv/bin/python scripts/train_judge.py --out /tmp/judge            # data, LoRA SFT, GGUF q8_0
    .venv/bin/python scripts/judge_quality.py --models --scores yes_no --as-trained \
        --judge trained=/tmp/judge/run/export/gguf/model-q8_0.gguf    # its agreement on the test split
    .venv/bin/python scripts/grpo_seeds.py --seeds 0 --judge /tmp/judge/run/export/gguf/model-q8_0.gguf

The data: each question of the 2-digit-addition training split (data_recipes/data/arith_add2_train.jsonl,
which holds no test or validation question in either operand order) with one proposed answer,
written into the rubric below (RUBRIC and SYSTEM, as reward=judge sends them with
reward.rubric and reward.system) and answered "yes" or "no" as `arith_exact` scores that answer:
the label is the reward the judge stands in for, not a rule of this script. The proposed answers
are the kinds a policy writes: the number itself (bare or with whitespace, which arith_exact
accepts), the number off by a few or by tens, digits swapped, the number with words around it,
and words alone (random.Random(--seed)). The run is `python -m workbench` on that file, a
`messages` dataset, with the overrides printed before it starts.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.rollout import rewards  # noqa: E402

TRAIN = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"
# The judge's rubric and system message (reward.rubric, reward.system): the built-in rubric
# without the question, which the judge needs no more than arith_exact does, and a system message
# in place of SmolLM2's default one: 45 tokens a row instead of 80, the run's cost is in tokens.
RUBRIC = "Proposed answer: {completion}\nCorrect answer: {answer}\nIs the proposed answer correct?"
SYSTEM = "Reply with yes or no."
WORDS = ["The answer is {n}.", "{n}. The", "{n} is the answer", "{n}\n\nWhat", "Answer: {n}", "= {n}"]
NO_NUMBER = ["", "I don't know.", "The answer is", "Let me think", "What is the answer?", "none"]


def proposal(answer: int, rng: random.Random) -> str:
    """One proposed answer to a question whose answer is `answer`: right about half the time."""
    kind = rng.random()
    if kind < 0.45:  # the number, as the policy writes it when it is right
        return rng.choice(["{n}", "{n}", "{n}", " {n}", "{n}\n"]).format(n=answer)
    if kind < 0.70:  # close: the kind of miss a policy learning addition makes most
        return str(answer + rng.choice([d for d in range(-10, 11) if d]))
    if kind < 0.80:  # a carry or a tens digit wrong
        return str(max(0, answer + rng.choice([-100, -20, -10, 10, 20, 100])))
    if kind < 0.87:  # digits swapped or dropped
        s = str(answer)
        return s[::-1] if len(set(s)) > 1 and rng.random() < 0.5 else (s[:-1] or "0")
    if kind < 0.95:  # the number with words around it: arith_exact says no, right or not
        n = answer if rng.random() < 0.5 else answer + rng.choice([-1, 1])
        return rng.choice(WORDS).format(n=n)
    return rng.choice(NO_NUMBER)


def rows(seed: int, n: int) -> list[dict]:
    """`messages` rows: the system message, the rubric written with one question's answer and a
    proposal for it, and the yes/no reply."""
    rng = random.Random(seed)
    questions = [json.loads(x)["messages"] for x in TRAIN.read_text().splitlines()]
    rng.shuffle(questions)
    out = []
    for msgs in questions[:n]:
        answer = msgs[-1]["content"]
        said = proposal(int(answer), rng)
        yes = rewards.arith_exact([said], [answer])[0] == 1.0
        out.append({"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": RUBRIC.format(completion=said, answer=answer)},
                                 {"role": "assistant", "content": "yes" if yes else "no"}]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/judge", help="the data file and the run go here")
    ap.add_argument("--rows", type=int, default=4000, help="questions of the training split to use (<= 4000)")
    ap.add_argument("--seed", type=int, default=0, help="the proposals and the run's seed")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--lr", type=float, default=5e-4, help="LoRA's learning rate: one token to learn, from few rows")
    ap.add_argument("--gguf", default="q8_0", help="the GGUF type to export (f16, q8_0, ...)")
    a, extra = ap.parse_known_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = rows(a.seed, a.rows)
    (out / "judge_train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    yes = sum(r["messages"][-1]["content"] == "yes" for r in data)
    print(f"{len(data)} rows, {yes} answered yes ({100 * yes / len(data):.1f}%): {out / 'judge_train.jsonl'}", flush=True)
    cmd = [sys.executable, "-m", "workbench", f"data.path={out / 'judge_train.jsonl'}", f"output_dir={out / 'run'}",
           f"train.max_steps={a.steps}", f"optim.lr={a.lr}", f"train.seed={a.seed}", f"data.shuffle_seed={a.seed}",
           "train.resume=never", "eval=none", f"export.gguf=[{a.gguf}]", *extra]
    print(" ".join(cmd[1:]), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc == 0:
        print(f"judge: {out / 'run' / 'export' / 'gguf' / f'model-{a.gguf}.gguf'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
