"""A headline recipe over many seeds: held-out accuracy per seed, then min / median / max.

    python scripts/recipe_seeds.py gemma --seeds 0 1 2 3 4 5 6 7 --threads 1 --parallel 2
    python scripts/recipe_seeds.py smollm2 --seeds 0 1 2 3 4 5 6 7 --threads 2
    python scripts/recipe_seeds.py gemma --seeds 3 --split val -- optim.lr=3e-4   # choose on validation

Each run is `python -m workbench <recipe> train.seed=S data.shuffle_seed=S hardware.threads=T`
with no export and no evaluation before training, evaluated on the test split held out by meaning
(`--split val`: the validation split, for choosing a recipe; `--split both`: both from one run, the
choice read from the validation column only). `--parallel 2` runs two one-thread
runs side by side on a 2-core machine. Prints one JSON line per run (accuracy with its Wilson 95%
interval, the training loss at a few steps, the stall warning if the run gave one) and a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.evals.stats import wilson  # noqa: E402

RECIPES = {"smollm2": [], "gemma": ["experiment=gemma3_arith"]}  # smollm2: the embedded default (make run)
TASKS = {"test": "arith_add2", "val": "arith_add2_val"}
SPLITS = {"test": ["test"], "val": ["val"], "both": ["val", "test"]}
N = 200  # questions in each split (data_recipes/data/arith_add2*_eval.jsonl)
LOSS_AT = (10, 30, 100, 200)


def one(recipe: str, seed: int, threads: int, split: str, extra: list[str], work: Path) -> dict:
    tag = hashlib.sha1(" ".join(extra).encode()).hexdigest()[:8]  # runs with other overrides kept apart
    out = work / f"{recipe}_{split}_t{threads}_seed{seed}_{tag}"
    cmd = [sys.executable, "-m", "workbench", *RECIPES[recipe], f"train.seed={seed}", f"data.shuffle_seed={seed}",
           f"hardware.threads={threads}", "train.export=false", "eval.at_start=false",
           f"eval.tasks=[{','.join(TASKS[x] for x in SPLITS[split])}]", f"output_dir={out}", "train.resume=never", *extra]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    row = {"recipe": recipe, "seed": seed, "threads": threads, "split": split, "extra": extra,
           "seconds": round(time.perf_counter() - t), "exit": proc.returncode}
    if proc.returncode != 0:
        return {**row, "error": proc.stderr.strip().splitlines()[-1:] or ["?"]}
    results = json.loads((out / "results.json").read_text())
    scores = {}
    for x in SPLITS[split]:  # the first split listed is the one `accuracy` holds (the summary's)
        acc = results["eval_end"][f"eval/{TASKS[x]}/accuracy"]
        lo, hi = wilson(acc * N, N)
        scores[x] = {"accuracy": acc, "ci95": [round(lo, 3), round(hi, 3)]}
    losses = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("step") in LOSS_AT and "loss" in rec:
            losses[rec["step"]] = round(rec["loss"], 3)
    stalled = [x for x in (proc.stdout + proc.stderr).splitlines() if "has not improved for" in x]
    first = scores[SPLITS[split][0]]
    return {**row, **first, "splits": scores, "loss_at": losses, "stall_line": stalled[:1]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--split", choices=sorted(SPLITS), default="test")
    ap.add_argument("--work", type=Path, default=Path("/tmp/recipe_seeds"))
    ap.add_argument("--out", type=Path, help="append each JSON line here too")
    a, extra = ap.parse_known_args()  # the rest: workbench overrides (after --)
    a.extra = [x for x in extra if x != "--"]
    a.work.mkdir(parents=True, exist_ok=True)
    rows = []
    with ThreadPoolExecutor(a.parallel) as pool:
        for row in pool.map(lambda s: one(a.recipe, s, a.threads, a.split, a.extra, a.work), a.seeds):
            print(json.dumps(row), flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            rows.append(row)
    done = [r for r in rows if "splits" in r]
    for x in SPLITS[a.split]:
        accs = sorted(r["splits"][x]["accuracy"] for r in done)
        if accs:
            worst = min(done, key=lambda r: r["splits"][x]["accuracy"])
            print(f"{a.recipe} {x} threads={a.threads} {' '.join(a.extra)}: {len(accs)} seeds, "
                  f"min {accs[0]:.1%} (seed {worst['seed']}, {worst['splits'][x]['ci95']}), "
                  f"median {statistics.median(accs):.1%}, max {accs[-1]:.1%}")
    return 0 if len(done) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
