"""Rollouts one step ahead against the synchronous loop: steps/s and the learning curve of both.

    python scripts/bench.py async_rollouts                         # env=calc from agent_seeds.py's warm start, 20 steps each
    python scripts/bench.py async_rollouts --steps 4 --model tiny  # wiring only (random model, no learning)
    python scripts/bench.py async_rollouts --warm /tmp/agent_seeds/s0/calc_sft_mixed0-20/export/merged method.prompts_per_step=2

Two GRPO runs with the calculator environment, identical but for `method.async_rollouts`: the
synchronous loop (generate step k's episodes, then train on them) and the asynchronous one (a
background thread generates step k+1's episodes with a snapshot of step k's starting weights
while step k trains; workbench/rollout/async_rollouts.py). Same seed, data, steps and settings
(precision fp32, LoRA); the runs go one after the other in this process, and --rounds repeats
the pair, alternating which goes first, so load from other processes hits both alike.

Reported per side: wall seconds for the run's steps (first step excluded: it has nothing to
overlap with), steps/s, and their ratio; the learning curve (mean episode reward of each step's
rollout, and held-out accuracy with the tool before and after on --eval questions); for the
asynchronous side, how long the training thread waited for rollouts (`waited_s`). On a CPU the
two threads share the cores, so the overlap can only win what one thread leaves idle; the
docs/measurements/throughput.md reports what was measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py async_rollouts")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (from a warm start) or tiny (wiring only)")
    ap.add_argument("--warm", default=None, help="a warm-start model dir; default: scripts/agent_seeds.py's, made if needed")
    ap.add_argument("--sft-steps", type=int, default=20, help="the warm start's LoRA SFT steps (agent_seeds.py's)")
    ap.add_argument("--eval", type=int, default=100, help="held-out questions evaluated before and after (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    a, overrides = ap.parse_known_args(args)
    from benchmarks._common import compose
    from workbench.run.runner import Runner

    model = ["model=tiny", "env.max_new_tokens=8"] if a.model == "tiny" else [f"model.path={_warm(a)}"]
    base = ["method=grpo", "env=calc", *model, f"train.max_steps={a.steps}", f"train.seed={a.seed}",
            f"data.shuffle_seed={a.seed}", "precision=fp32", "train.log_every=5", "tracker=[]", "train.plots=false"]
    sides: dict[str, dict] = {"sync": {"walls": [], "curves": [], "evals": []}, "async": {"walls": [], "curves": [],
                                                                                           "evals": []}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                out = Path(tmp) / f"{name}{r}"
                cfg = compose([*base, f"method.async_rollouts={str(name == 'async').lower()}", *overrides], out)
                if a.eval:  # compose() turns evaluation off; the curve's ends are held-out accuracy with the tool
                    from omegaconf import OmegaConf

                    cfg = OmegaConf.merge(cfg, {"eval": {"tasks": ["env"], "num_samples": a.eval, "at_start": True,
                                                         "at_end": True}})
                    OmegaConf.set_readonly(cfg, True)
                runner = Runner(cfg)
                t = time.perf_counter()
                res = runner.train()
                wall = time.perf_counter() - t
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                steps = [x for x in rows if "eval" not in x]
                s = sides[name]
                s["walls"].append(sum(x["step_seconds"] for x in steps[1:]))
                s["curves"].append([round(x["reward"], 4) for x in steps])
                s.setdefault("run_wall_s", []).append(round(wall, 1))
                if a.eval:
                    s["evals"].append([res["eval_start"]["eval/env/accuracy"], res["eval_end"]["eval/env/accuracy"]])
                if name == "async":
                    s.setdefault("waited_s", []).append(round(runner.method._async.waited, 1))
    out = {"steps": a.steps, "rounds": a.rounds, "model": a.model, "overrides": overrides}
    for name, s in sides.items():
        w = statistics.median(s["walls"])
        out[name] = {"seconds_steps_2_on": round(w, 1), "steps_per_s": round((a.steps - 1) / w, 5),
                     "reward_curve": s["curves"], "heldout_accuracy_before_after": s["evals"],
                     "run_wall_s": s["run_wall_s"], **({"waited_s": s["waited_s"]} if "waited_s" in s else {})}
    out["async_speedup"] = round(out["async"]["steps_per_s"] / out["sync"]["steps_per_s"], 3)
    return out


def _warm(a) -> str:
    if a.warm:
        return a.warm
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from agent_seeds import warm_start

    return str(warm_start(a.seed, a.sft_steps, Path("/tmp/agent_seeds") / f"s{a.seed}"))
