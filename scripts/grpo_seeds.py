"""GRPO learning across seeds on the embedded task: the table behind docs/measurements/learning.md's GRPO numbers.

    python scripts/grpo_seeds.py --seeds 0 1 2 3 4 5 --from-base      # method=grpo as shipped, from SmolLM2
    python scripts/grpo_seeds.py --seeds 0 1 2 reward=arith_exact      # from a 20-step SFT warm start
    python scripts/grpo_seeds.py --seeds 0 5 --from-base precision=fp32   # another precision
    python scripts/grpo_seeds.py --seeds 5 --from-base reward=arith_format method.scale_rewards=group  # any override
    python scripts/grpo_seeds.py --seeds 0 1 --serve arith_exact       # the reward from a server, reward=http
    python scripts/grpo_seeds.py --seeds 0 --judge /tmp/judge/run/export/gguf/model-q8_0.gguf   # reward=judge

With --serve NAME the reward is reward function NAME served over HTTP by the reference server
(workbench/rollout/reward_server.py, in a thread of this process) and read with `reward=http`;
each row keeps its per-step loss and reward, so a served run can be held to the in-process run
of the same seed (`--compare A.jsonl B.jsonl`: equal curves, step by step). With --judge GGUF
the reward is `reward=judge` (yes/no by log-probabilities) asked of that GGUF, a judge that
scripts/train_judge.py makes, with the rubric and system message it was trained on, served by
llama.cpp's server on loopback (scripts/judge_quality.py's `serve`); each row adds the judge's
calls, cache hits and seconds.

For each seed: (unless --from-base) 20 LoRA SFT steps with that seed, merged, as the starting
policy; then GRPO on it with the given overrides, held-out 2-digit-addition exact match
(the 200-question test split and the 200-question validation split, greedy) before and
after, each with its Wilson 95% interval. Prints one JSON line per seed and a summary line,
and appends them to --out (default runs/grpo_seeds.jsonl).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMON = ["train.export=false", "train.resume=never", "train.log_every=10", "eval.at_start=true",
          "eval.at_end=true", "eval.num_samples=200", "eval.tasks=[arith_add2,arith_add2_val]"]


def one_seed(seed: int, steps: int, from_base: bool, overrides: list[str], out: Path, sft_precision: str,
             serve: str | None = None, judge: Path | None = None) -> dict:
    from scripts.judge_quality import free_port
    from scripts.judge_quality import serve as serve_gguf
    from scripts.train_judge import RUBRIC, SYSTEM
    from tests.conftest import train
    from workbench.rollout.reward_server import RewardServer

    model = []
    if not from_base:
        merged = out / f"sft{seed}" / "export" / "merged"
        if not (merged / "config.json").exists():  # the warm start depends on the seed only: made once per --work
            train(["train.max_steps=20", f"train.seed={seed}", f"data.shuffle_seed={seed}", "train.resume=never",
                   "eval=none", "train.export=true", f"precision={sft_precision}"], out / f"sft{seed}", base=[])
        model = [f"model.path={merged}"]
    t = time.perf_counter()
    run_dir = out / f"grpo{seed}-{int(time.time())}"
    server = RewardServer(serve).start() if serve else None
    judge_proc, served = None, []
    if server:
        served = ["reward=http", f"reward.url={server.url}"]
    elif judge:  # one llama.cpp thread: the run's own generation and training take the other core
        judge_proc, url, _ = serve_gguf(judge, free_port(), threads=1)
        served = ["reward=judge", f"reward.base_url={url}", "reward.concurrency=1", f"reward.rubric='{RUBRIC}'",
                  f"reward.system='{SYSTEM}'"]
    try:
        res = train(["method=grpo", *model, f"train.max_steps={steps}", f"train.seed={seed}", f"data.shuffle_seed={seed}",
                     *COMMON, *overrides, *served], run_dir, base=[])
    finally:
        if server:
            server.stop()
        if judge_proc:
            judge_proc.terminate()
            judge_proc.wait(10)
    return {"seed": seed, "from_base": from_base, "steps": steps, "overrides": overrides, "sft_precision": sft_precision,
            "served": serve, "requests": server.requests if server else 0, "judge": str(judge) if judge else None,
            **judge_totals(run_dir),
            **scored(res, "eval/arith_add2"), **scored(res, "eval/arith_add2_val", "val_"),
            "grpo_seconds": round(time.perf_counter() - t), "curve": curve(run_dir)}


def curve(run_dir: Path) -> list[dict]:
    """The logged training rows' step, loss and reward (what --compare holds two runs to)."""
    from workbench.telemetry.compare import read_run

    return [{k: r.get(k) for k in ("step", "loss", "reward", "reward_std")} for r in read_run(run_dir).rows]


def judge_totals(run_dir: Path) -> dict:
    """reward=judge's calls, cache hits and seconds summed over the logged steps (none: {})."""
    from workbench.telemetry.compare import read_run

    rows = [r for r in read_run(run_dir).rows if "judge_calls" in r]
    return {k: round(sum(r[k] for r in rows), 1) for k in ("judge_calls", "judge_cache_hits", "judge_seconds")} if rows else {}


def compare(a: Path, b: Path) -> int:
    """Seed by seed, the largest difference between two files' curves (0 when a served reward
    carries the in-process reward's float64 scores exactly)."""
    def rows(p):
        return {r["seed"]: r for r in map(json.loads, p.read_text().splitlines()) if "curve" in r}

    ra, rb = rows(a), rows(b)
    worst = 0.0
    for seed in sorted(set(ra) & set(rb)):
        ca, cb = ra[seed]["curve"], rb[seed]["curve"]
        diffs = [abs(x[k] - y[k]) for x, y in zip(ca, cb, strict=True) for k in ("loss", "reward", "reward_std")
                 if x[k] is not None and y[k] is not None]
        worst = max(worst, *diffs)
        print(f"seed {seed}: {len(ca)} logged steps, largest difference {max(diffs):.3g}; held out "
              f"{ra[seed]['after']:.3f} and {rb[seed]['after']:.3f}")
    print(f"largest difference over every seed: {worst:.3g}")
    return 0


def scored(res: dict, prefix: str, tag: str = "") -> dict:
    """before/after accuracy of one eval task with the after value's Wilson 95% interval."""
    from workbench.evals.stats import intervals

    end, start = res["eval_end"], res.get("eval_start") or {}  # eval.at_start=false: no start (None)
    return {f"{tag}before": start.get(f"{prefix}/accuracy"), f"{tag}after": end[f"{prefix}/accuracy"],
            f"{tag}after_ci95": intervals(end).get(f"{prefix}/accuracy_ci95")}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="grpo_seeds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps (100: method=grpo's own)")
    ap.add_argument("--from-base", action="store_true", help="start from SmolLM2 itself, no SFT warm start")
    ap.add_argument("--sft-precision", default="bf16-mixed", help="the warm start's precision (fp32: 5x faster on "
                    "CPUs without native bf16)")
    ap.add_argument("--work", default="/tmp/grpo_seeds")
    ap.add_argument("--out", default=str(ROOT / "runs" / "grpo_seeds.jsonl"))
    ap.add_argument("--serve", metavar="REWARD", help="serve reward function REWARD over HTTP; the run reads it "
                    "with reward=http")
    ap.add_argument("--judge", type=Path, metavar="GGUF", help="reward=judge: serve this GGUF with llama.cpp's "
                    "server and ask it (yes/no)")
    ap.add_argument("--compare", nargs=2, metavar="JSONL", help="compare two files' curves seed by seed, run nothing")
    # key=value words are Hydra overrides wherever they stand: `--seeds 0 1 2 reward=arith_exact`
    # would otherwise hand "reward=arith_exact" to --seeds
    overrides = [w for w in argv if "=" in w and not w.startswith("-")]
    a, unknown = ap.parse_known_args([w for w in argv if w not in overrides])
    if unknown:
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    if a.compare:
        return compare(*map(Path, a.compare))
    rows = []
    for seed in a.seeds:
        row = one_seed(seed, a.steps, a.from_base, overrides, Path(a.work) / f"s{seed}", a.sft_precision,
                       a.serve, a.judge)
        rows.append(row)
        print(json.dumps(row), flush=True)
    gains = [r["after"] - (r["before"] or 0.0) for r in rows]  # without a start eval: gain over 0
    summary = {"summary": True, "overrides": overrides, "from_base": a.from_base, "served": a.serve,
               "judge": str(a.judge) if a.judge else None, "gains": gains,
               "mean_gain": sum(gains) / len(gains), "min_gain": min(gains),
               "max_grpo_seconds": max(r["grpo_seconds"] for r in rows)}
    print(json.dumps(summary))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "a") as fh:
        for r in [*rows, summary]:
            fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
