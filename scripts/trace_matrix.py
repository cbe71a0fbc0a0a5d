"""The planner held to the traced step at the shapes people rent GPUs for: each cell is
`python -m workbench ... dry_run=trace plan.json=true` (workbench/plan/trace.py), its traced peak
per device beside the plan's, written to docs/measurements/trace-matrix.md.

    .venv/bin/python scripts/trace_matrix.py                 # every cell (minutes each on 2 cores)
    .venv/bin/python scripts/trace_matrix.py --cells 8b-sft-lora 70b-dpo-lora --out /tmp/m.md

A cell that cannot be traced is listed with its reason, never with a number. Where the plan is
off the trace by more than 10%, the row names the term whose difference is largest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "measurements" / "trace-matrix.md"
BATCH = ["train.micro_batch_size=1", "train.grad_accum=16", "data.seq_len=2048"]
METHODS = {"sft-full": ["method=sft", "peft=none"], "sft-lora": ["method=sft", "peft=lora"],
           "dpo-lora": ["method=dpo", "peft=lora"]}
CELLS = {f"{model}-{name}": [f"model={model}", *ov, "backend=fsdp2", "hardware=8xh100", *BATCH]
         for model in ("8b", "70b") for name, ov in METHODS.items()}
OFF = 0.10  # the bar for the planner against the trace
# What the traced categories showed (the cells' "categories_gb" in plan.json), kept with the table.
READING = [
    "Reading the table (from the traced categories of each cell, `plan.json=true` under `plan.trace`):",
    "",
    "- Full fine-tuning that accumulates under FSDP2 held the whole model's gradient unsharded on every",
    "  rank, when `backend=fsdp2` turned gradient sync off for every micro-batch but the last: at 70B",
    "  266.7 GiB of temporaries in a traced 437.3 (the fp32 gradient, 70.55 B x 4 bytes = 262.8 GiB), at 8B",
    "  31.9 of 59.8. `backend.sync_each_micro_batch=auto` now reduce-scatters after every micro-batch",
    "  unless only adapters train (workbench/backends/spec.py `syncs_each_micro_batch`): 70B traces",
    "  209.7 GiB, 8B 33.6. `false` keeps the old behaviour, and the planner counts the unsharded",
    "  gradients there (8B: plan 61.1, traced 59.8).",
    "- The planner's backward left out two terms. Under FSDP2 (`fsdp_regather` in",
    "  workbench/plan/memory.py) it counted only the logits' gradient in the compute dtype at the head,",
    "  not the loss's fp32 log-softmax with both of its gradients (12 bytes per logit), which are alive",
    "  before the root is gathered again: DPO's two rows at 8B were -13.2% (4.1 GiB of temporaries",
    "  traced); `model=tiny method=dpo backend=fsdp2 hardware.procs=2`, whose vocabulary-wide logits",
    "  dominate, planned 0.8 GiB against 4.5 traced, now 4.5. And in every micro-batch after the",
    "  first, the gradients accumulated so far (sharded under FSDP2) sit beside the activations.",
    "- The trace no longer counts DTensor's global-shape shadows: DTensor sizes an op's output by",
    "  running it on fake tensors of the whole parameter's shape in the fake mode it finds, which was",
    "  the trace's own (`global_shapes_apart` in workbench/plan/fake.py); at 8B full fine-tuning a",
    "  foreach AdamW op over the fp32 moments showed 29.9 GiB no rank holds.",
    "- LoRA keeps no sync before the last micro-batch under `auto` (its unsharded adapter gradients,",
    "  0.8 GiB at 70B, are counted in the plan's grads).",
    "",
]


def run_cell(overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "workbench", *overrides, "dry_run=trace", "plan.json=true",
           "output_dir=/tmp/trace-matrix"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode not in (0, 4):
        return {"error": " ".join(proc.stderr.strip().splitlines()[-1:])[:300]}
    plan = json.loads(proc.stdout)["plan"]
    return {"plan": plan, "trace": plan["trace"], "wall_s": round(time.perf_counter() - t0)}


def plan_terms(plan: dict) -> dict[str, float]:
    from workbench.plan.trace import plan_terms as terms

    return terms(plan)


def row(name: str, overrides: list[str], got: dict) -> str:
    if "error" in got:
        return f"| {name} | `{' '.join(overrides)}` | failed: {got['error']} | | | | |"
    t, plan = got["trace"], got["plan"]
    if not t["traced"]:
        return f"| {name} | `{' '.join(overrides)}` | {plan['memory_gb']['peak']:.1f} | not traced: {t['reason']} | | | |"
    diff = t["plan_vs_trace"]
    note = ""
    if abs(diff) > OFF:
        ours = plan_terms(plan)
        worst = max(ours, key=lambda k: abs(ours[k] - t["terms_gb"][k]))
        note = f"plan off by more than {OFF:.0%}: {worst} (plan {ours[worst]:.1f}, traced {t['terms_gb'][worst]:.1f})"
    where = f"{t['where']['phase']}, {t['where']['module']}"
    return (f"| {name} | `{' '.join(overrides)}` | {plan['memory_gb']['peak']:.1f} | {t['peak_gb']:.1f} | "
            f"{diff:+.1%} | {where} | {note} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="*", default=list(CELLS))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    rows = []
    for name in args.cells:
        got = run_cell(CELLS[name])
        print(name, json.dumps({k: v for k, v in got.items() if k != "plan"})[:600], flush=True)
        rows.append(row(name, CELLS[name], got))
    text = "\n".join([
        "# The planner against the traced step",
        "",
        "Each row: the plan's peak per device (workbench/plan/memory.py) and the peak of the training step",
        "executed at its real shape on fake tensors as rank 0 of a fake process group of 8",
        "(`dry_run=trace`, workbench/plan/trace.py; the planner guide says what is traced and what is not).",
        "Both are GiB per device on `hardware=8xh100` (80 GB, 72 usable); \"plan vs trace\" is plan / traced - 1.",
        "Generated by `scripts/trace_matrix.py` (one pair or row per micro-batch, data.seq_len=2048,",
        "train.grad_accum=16, of which the trace runs two micro-batches).",
        "",
        "| cell | command | plan GiB | traced GiB | plan vs trace | traced peak in | note |",
        "|---|---|---|---|---|---|---|",
        *rows, "", *READING])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
