"""Learning outcomes of the methods beyond SFT/DPO/GRPO across seeds (docs/measurements/learning.md's table).

    python scripts/method_seeds.py dpo kto simpo orpo rm --seeds 0 1 2
    python scripts/method_seeds.py distill grpo_rm --seeds 0 --work /tmp/seeds
    python scripts/method_seeds.py needle needle_base --seeds 0 1 2   # the long-context task

The runs are those of tests/integration/test_learning_methods.py (SmolLM2-135M, LoRA, fp32, 60
steps, KTO 100), evaluated on the whole test split (200 questions or pairs); each seed sets
train.seed and data.shuffle_seed. Prints one JSON line per run and a table at the end, each
accuracy after training with its Wilson 95% interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration import test_learning_long_context as N  # noqa: E402
from tests.integration import test_learning_methods as L  # noqa: E402
from workbench.evals.stats import wilson  # noqa: E402

TEST_N = 200  # every test split these runs read holds 200 questions or pairs (data_recipes/data/*_eval.jsonl)


def one(name: str, seed: int, work: Path) -> dict:
    out = work / f"{name}_seed{seed}"
    t = time.perf_counter()
    if name in L.RECIPES:
        before, after, _ = L.run_recipe(name, seed, out)
        row = {"before": before, "after": after}
    elif name == "distill":
        teacher, before, after = L.distill(out, seed)
        row = {"teacher": teacher, "before": before, "after": after,
               "gap_closed": (after - before) / max(1e-9, teacher - before)}
    elif name == "rm_sft":
        acc, warm = L.rm_from_sft(out, seed)
        row = {"before": warm["eval_end"]["eval/arith_add2/accuracy"], "after": acc}  # before: the SFT's exact match
    elif name == "grpo_rm":
        rm_acc, before, after = L.grpo_with_reward_model(out, seed)
        row = {"rm_accuracy": rm_acc, "before": before, "after": after}
    elif name in ("needle", "needle_base"):  # the long-context task; its base model is greedy, the same at any seed
        res = N.needle(seed, out)["eval_end"] if name == "needle" else N.needle_base(out)["eval_start"]
        row = {"before": None, "after": res[N.ACCURACY], "found": res[N.FOUND]}
    else:
        raise SystemExit(f"unknown run {name!r}: choose from "
                         f"{[*L.RECIPES, 'rm_sft', 'distill', 'grpo_rm', 'needle', 'needle_base']}")
    n = N.EVAL_N if name.startswith("needle") else TEST_N
    lo, hi = wilson(row["after"] * n, n)
    return {"run": name, "seed": seed, **row, "after_ci95": [round(lo, 3), round(hi, 3)],
            "seconds": round(time.perf_counter() - t)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temp dir)")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="method_seeds_"))
    rows = []
    for name in args.runs:
        for seed in args.seeds:
            rows.append(one(name, seed, work))
            print(json.dumps(rows[-1]), flush=True)
    print("\n| run | seed | before | after [95%] | seconds |\n|---|---|---|---|---|")
    for r in rows:
        before = "-" if r["before"] is None else f"{r['before']:.3f}"
        lo, hi = r["after_ci95"]
        print(f"| {r['run']} | {r['seed']} | {before} | {r['after']:.3f} [{lo:.3f}, {hi:.3f}] | {r['seconds']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
