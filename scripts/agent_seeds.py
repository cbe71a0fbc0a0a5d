"""Tool-use RL across seeds: the calculator environment's table in docs/measurements/learning.md.

    python scripts/agent_seeds.py --seeds 0 1 2                         # warm start + GRPO, precision fp32
    python scripts/agent_seeds.py --seeds 0 --sft-steps 6 --steps 40 optim.lr=1e-4   # any GRPO override
    python scripts/agent_seeds.py --seeds 0 --steps 0                    # the warm start alone, evaluated
    python scripts/agent_seeds.py --seeds 0 method.async_rollouts=true   # the same with rollouts one step ahead
    python scripts/agent_seeds.py --seeds 0 --env openenv                # the calculator served over OpenEnv's protocol

For each seed: a short LoRA SFT warm start (--recipe, default data_recipes/calc_sft_mixed.yaml:
one tool-use episode to three bare answers; --sft-steps steps with that seed), merged; then GRPO with
env=calc from it (--env openenv: the same calculator served as an OpenEnv environment, started by
the run: env.serve=workbench.envs.openenv_calc:app) (--steps steps, the given overrides), evaluated before and after on the first
100 held-out questions (eval.tasks=[env], greedy episodes): accuracy, and the share of final
answers that follow a tool result. Prints one JSON line per seed and a summary line, and appends
them to --out (default runs/agent_seeds.jsonl). The warm start depends on the seed, --recipe
and --sft-steps only, and is made once per --work directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMON = ["train.export=false", "train.resume=never", "train.log_every=5", "eval.at_start=true", "eval.at_end=true",
          "eval.num_samples=100", "eval.tasks=[env]", "precision=fp32"]
RECIPE = "calc_sft_mixed"  # the warm start's data: one tool episode to three bare answers


def warm_start(seed: int, steps: int, work: Path, recipe: str = RECIPE) -> Path:
    from tests.conftest import train

    merged = work / f"{recipe}{seed}-{steps}" / "export" / "merged"
    if not (merged / "config.json").exists():
        train([f"train.max_steps={steps}", f"train.seed={seed}", f"data.shuffle_seed={seed}", f"data.recipe={recipe}",
               "train.resume=never", "eval=none", "train.export=true", "precision=fp32", "optim.warmup_steps=0"],
              work / f"{recipe}{seed}-{steps}", base=[])
    return merged


ENVS = {"calc": ["env=calc"], "openenv": ["env=openenv", "env.serve=workbench.envs.openenv_calc:app"]}


def one_seed(seed: int, sft_steps: int, steps: int, overrides: list[str], work: Path, recipe: str,
             env: str = "calc") -> dict:
    from tests.conftest import train

    merged = warm_start(seed, sft_steps, work, recipe)
    t = time.perf_counter()
    out = work / f"grpo{seed}-{int(time.time())}"
    res = train(["method=grpo", *ENVS[env], f"model.path={merged}", f"train.max_steps={steps}", f"train.seed={seed}",
                 f"data.shuffle_seed={seed}", *COMMON, *(["eval.at_end=false"] if steps == 0 else []), *overrides],
                out, base=[])
    start, end = res["eval_start"], res.get("eval_end") or res["eval_start"]
    row = {"seed": seed, "env": env, "recipe": recipe, "sft_steps": sft_steps, "steps": steps, "overrides": overrides,
           "run": str(out),
           "before": start["eval/env/accuracy"], "after": end["eval/env/accuracy"],
           "after_tool_before": start["eval/env/answer_after_tool"], "after_tool_after": end["eval/env/answer_after_tool"],
           "grpo_seconds": round(time.perf_counter() - t)}
    if res.get("stalled"):
        row["stalled"] = res["stalled"]["reason"]
    return row


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="agent_seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--sft-steps", type=int, default=20, help="LoRA SFT steps of the warm start (16 demonstrations each)")
    ap.add_argument("--recipe", default=RECIPE, help="the warm start's data recipe (calc_sft: tool episodes only)")
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps (0: evaluate the warm start only)")
    ap.add_argument("--env", choices=sorted(ENVS), default="calc")
    ap.add_argument("--work", default="/tmp/agent_seeds")
    ap.add_argument("--out", default=str(ROOT / "runs" / "agent_seeds.jsonl"))
    a, overrides = ap.parse_known_args(argv)
    rows = []
    for seed in a.seeds:
        row = one_seed(seed, a.sft_steps, a.steps, overrides, Path(a.work) / f"s{seed}", a.recipe, a.env)
        rows.append(row)
        print(json.dumps(row), flush=True)
    gains = [r["after"] - r["before"] for r in rows]
    summary = {"summary": True, "env": a.env, "overrides": overrides, "recipe": a.recipe, "sft_steps": a.sft_steps,
               "steps": a.steps,
               "gains": gains,
               "mean_gain": sum(gains) / len(gains), "min_gain": min(gains),
               "min_after_tool": min(r["after_tool_after"] for r in rows),
               "max_grpo_seconds": max(r["grpo_seconds"] for r in rows)}
    print(json.dumps(summary))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as fh:
        for r in [*rows, summary]:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
