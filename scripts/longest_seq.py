"""The longest sequence a model trains at on this machine, at each sequence-parallel size.

    python scripts/longest_seq.py --known 8192           # SmolLM2-135M, LoRA, sp 1 and 2: plan, then runs
    python scripts/longest_seq.py --plan-only --sp 1 2 4
    python scripts/longest_seq.py --length 28672 --sp 1  # just the run, at a length of your choosing

How the length is found, for each sp: first the plan's bound, the largest `data.seq_len` (a
multiple of --step) whose plan fits this machine (`dry_run=true plan.json=true`, the `here` row:
on a CPU the processes share the host's memory, so each of sp ranks gets 1/sp of it), by
doubling then bisecting; no weights load for that. The memory the plan may use is what the host
has available now less --reserve GiB per rank (`hardware.memory_gb`). Then one-step runs
bisect between --known (a length known to train) and that bound: a length counts when its step
finishes and the host kept --margin GiB free throughout (sampled every 0.2 s), so what decides is
the host's own memory (all ranks, the runtime, the allocator), not only the tensors the plan
counts. One document per row (no packing, so PyTorch's causal attention kernel runs with no
mask), `model.loss_chunk` on, the plan check on the step (its tensor peak against the
prediction, the resident set) and its tokens/s. One step, because a step at ~20k tokens takes
minutes of CPU.

glibc's allocator keeps freed blocks for reuse, and on long rows that slack was most of the gap
between the plan and the host; `MALLOC_MMAP_THRESHOLD_=131072 python scripts/longest_seq.py`
returns large blocks at once (the row records it).

Beyond the model's context (SmolLM2: 8,192 positions) `model.arch.max_position` is raised to
the length: RoPE runs past the length it was trained at, which is what a context-extension run
does (usually with a larger rope_theta); for memory and speed the positions make no difference.

The rows are the long-context task's station-log sentences (workbench/data/needle.py) strung
together past the length and truncated to it. Prints one JSON line per step of the search and
per run, and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from workbench.data import needle  # noqa: E402

GiB = 2**30
CONTEXT = 8192  # SmolLM2-135M's max_position (conf/model/smollm2-135m.yaml)


def common(args, length: int, sp: int) -> list[str]:
    return [f"model={args.model}", f"method={args.method}", "eval=none", "data.packing=false",
            f"data.seq_len={length}", f"model.arch.max_position={max(CONTEXT, length)}",
            "train.micro_batch_size=1", f"model.loss_chunk={args.loss_chunk}", f"backend.sp={sp}",
            f"hardware.procs={sp}", "train.export=false", "train.resume=never", *args.overrides]


def workbench(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *argv], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def plan(args, length: int, sp: int, data: Path) -> dict:
    """The `here` row of the plan at this length: fits, peak_gb (per rank), usable_gb."""
    budget = available() - args.reserve * sp
    p = workbench([*common(args, length, sp), f"data.path={data}", "dry_run=true", "plan.json=true",
                   f"hardware.memory_gb={budget:.2f}"])
    if p.returncode not in (0, 4):  # 4: the plan does not fit, and it is printed (its `here` row below)
        return {"fits": False, "refused": (p.stderr or p.stdout).strip().splitlines()[-1]}
    out = json.loads(p.stdout[p.stdout.index("{"):])
    return out["plan"]["here"]


def longest_planned(args, sp: int, data: Path) -> tuple[int, list[dict]]:
    """The largest multiple of args.step whose plan fits (0 if even args.step does not)."""
    seen = []

    def fits(n: int) -> bool:
        row = plan(args, n, sp, data)
        seen.append({"sp": sp, "seq_len": n, "fits": row["fits"], "peak_gb": row.get("peak_gb"),
                     "usable_gb": row.get("usable_gb"), "refused": row.get("refused")})
        print(json.dumps(seen[-1]), flush=True)
        return row["fits"]

    lo, hi = 0, args.step
    while fits(hi):  # double until it does not fit
        lo, hi = hi, hi * 2
        if hi > args.max_len:
            return lo, seen
    while hi - lo > args.step:  # bisect in whole steps
        mid = (lo + hi) // 2 // args.step * args.step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, seen


class HostMemory:
    """The host's smallest MemAvailable while it runs (sampled every 0.2 s), in GiB."""

    def __init__(self):
        self.low, self._stop = available(), threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)

    def _watch(self):
        while not self._stop.wait(0.2):
            self.low = min(self.low, available())

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def available() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def run(args, length: int, sp: int, data: Path, out: Path) -> dict:
    """One step at this length: the plan check on it, its tokens/s, the host's memory."""
    threads = max(1, args.cores // sp)
    before = available()
    t = time.perf_counter()
    with HostMemory() as host:
        p = workbench([*common(args, length, sp), f"data.path={data}", "train.max_steps=1", "train.log_every=1",
                       "plan.check_after_steps=1", f"hardware.threads={threads}", f"output_dir={out}"],
                      env={"OMP_NUM_THREADS": str(threads)})
    row = {"sp": sp, "seq_len": length, "threads_per_rank": threads, "ok": p.returncode == 0,
           "host_used_gib": round(before - host.low, 2), "host_free_gib": round(host.low, 2),
           "seconds": round(time.perf_counter() - t),
           "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}  # glibc's, when set
    if p.returncode:
        row["error"] = (p.stderr or p.stdout).strip().splitlines()[-3:]
        return row
    res = json.loads((out / "results.json").read_text())
    check = res.get("plan_check") or {}
    figures = check.get("figures", {})
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    last = steps[-1] if steps else {}
    row.update(peak_predicted_gib=figures.get("peak_gib", {}).get("predicted"),
               peak_measured_gib=figures.get("peak_gib", {}).get("measured"),
               resident_rank0_gib=check.get("resident_gib"),
               tokens_per_s=last.get("tokens_per_s"), step_seconds=last.get("step_seconds"))
    return row


def trial(args, length: int, sp: int, work: Path) -> dict:
    """One step at this length on rows made for it, printed as it finishes."""
    row = run(args, length, sp, rows_file(length, 4, work / f"rows_{length}.jsonl"), work / f"sp{sp}_{length}")
    print(json.dumps(row), flush=True)
    return row


def longest_run(args, sp: int, planned: int, work: Path) -> dict:
    """The longest multiple of args.step that trains one step and leaves the host args.margin
    free: the plan's length first, then bisection between args.known (a length known to train,
    else 0) and the shortest length that failed. The plan bounds it from above: it counts
    tensors, and the host also holds the runtime and what the allocator keeps."""
    lo, hi, best = args.known, planned + args.step, {"sp": sp, "seq_len": 0, "ok": False}
    n = planned
    while hi - lo > args.step:
        row = trial(args, n, sp, work)
        if row["ok"] and row["host_free_gib"] >= args.margin:
            lo, best = n, row
        else:
            hi = n
        n = (lo + hi) // 2 // args.step * args.step
    return best


def rows_file(length: int, n: int, path: Path) -> Path:
    """n text rows of at least `length` SmolLM2 tokens (about 1.3 per word; 1.6 words leaves room)."""
    rng = random.Random("longest-seq")
    names = needle.pools()["train"]
    with path.open("w") as f:
        for _ in range(n):
            parts, words = [], 0
            while words < length * 1.6 / 1.3 * 0.85:
                prompt, _, _ = needle.log_row(rng, names)
                parts.append(prompt)
                words += len(prompt.split())
            f.write(json.dumps({"text": " ".join(parts)}) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="lora")
    ap.add_argument("--loss-chunk", type=int, default=512)
    ap.add_argument("--step", type=int, default=1024, help="lengths are multiples of this")
    ap.add_argument("--max-len", type=int, default=1 << 20)
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads shared by the ranks")
    ap.add_argument("--margin", type=float, default=0.5, help="GiB of the host a run must leave free")
    ap.add_argument("--reserve", type=float, default=0.75, help="GiB per rank beyond its tensors")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--length", type=int, default=0, help="skip the search: run at this length")
    ap.add_argument("--known", type=int, default=0, help="a length known to train: the runs' search starts there")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="more workbench overrides for every run")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="longest_seq_"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for sp in args.sp:
        if args.length:
            results.append(trial(args, args.length, sp, work))
            continue
        planned, _ = longest_planned(args, sp, rows_file(args.step, 1, work / "probe.jsonl"))
        print(json.dumps({"sp": sp, "longest_planned": planned}), flush=True)
        if args.plan_only or not planned:
            results.append({"sp": sp, "seq_len": planned, "planned_only": True})
            continue
        results.append(longest_run(args, sp, planned, work))
    print("\n| sp | longest seq_len | tensor peak/rank predicted GiB | measured | resident rank 0 GiB "
          "| host used GiB | tokens/s | step s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        cells = [f"{r.get(k):.2f}" if isinstance(r.get(k), float) else str(r.get(k, "-"))
                 for k in ("peak_predicted_gib", "peak_measured_gib", "resident_rank0_gib", "host_used_gib",
                          "tokens_per_s", "step_seconds")]
        print(f"| {r['sp']} | {r['seq_len']:,} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
