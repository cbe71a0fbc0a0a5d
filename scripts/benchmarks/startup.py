"""Seconds from `python -m workbench` to the end of its first optimizer step, warm cache.

    python scripts/bench.py startup                        # the default run (make run), 5 launches
    python scripts/bench.py startup --launches 5 precision=bf16-mixed

Each launch is the default job with `eval=none train.export=false train.max_steps=1` (the
evaluation before training and the export after it are not start-up) plus any overrides given.
One launch first fills the caches (converted model, tokenised data, the matmul peak, Python's
bytecode) and is not counted. Reported: the median and every launch, split into the time before the first step
started (imports, config, preflight, model load) and the step itself (`step_seconds` of
metrics.jsonl), and how long a bare `python -c` importing torch, transformers, peft and the Llama
modelling code takes on this machine: as the launch imports them (garbage collector paused,
scipy and boto3 hidden: workbench/core/startup.py, workbench/core/imports.py), the floor under the time
before the step, and plainly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Python's bytecode cache is part of a warm start: a shell with PYTHONDONTWRITEBYTECODE set would
# recompile the workbench's own modules on every launch.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
# what a LoRA run imports before its first step; bitsandbytes is blocked as the CLI blocks it
# when nothing quantises (workbench/cli.py)
IMPORTS = ("import sys; sys.modules['bitsandbytes'] = None; import torch, transformers, peft; "
           "from transformers import AutoModelForCausalLM; from transformers.models.llama import modeling_llama")
AS_LAUNCHED = ("from workbench import startup; startup.pause(); from workbench.core.imports import import_without_incidentals; "
               "import_without_incidentals('transformers.modeling_utils'); " + IMPORTS)


def launch(out: Path, overrides: list[str]) -> dict:
    """One launch: seconds to the end of the first optimizer step, and that step's own seconds."""
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "workbench", "eval=none", "train.export=false", "train.max_steps=1",
                    "train.resume=never", f"output_dir={out}", *overrides], cwd=ROOT, check=True, capture_output=True,
                   env=ENV)
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    total = row["time"] - t0
    return {"seconds": total, "step_seconds": row["step_seconds"], "before_step": total - row["step_seconds"]}


def import_seconds(line: str) -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", line], cwd=ROOT, check=True, capture_output=True, env=ENV)
    return time.time() - t0


def median_launch(n: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        launch(Path(tmp) / "warm", overrides)  # fills the caches; not counted
        runs = [launch(Path(tmp) / f"l{i}", overrides) for i in range(n)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {"launches": n, "overrides": overrides, "median_seconds": med["seconds"],
            "median_before_step": med["before_step"], "median_step_seconds": med["step_seconds"],
            "seconds": [r["seconds"] for r in runs]}


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py startup")
    ap.add_argument("--launches", type=int, default=5)
    a, overrides = ap.parse_known_args(argv)
    result = median_launch(a.launches, overrides)
    result["imports_seconds"] = statistics.median(import_seconds(AS_LAUNCHED) for _ in range(3))
    result["imports_seconds_plain"] = statistics.median(import_seconds(IMPORTS) for _ in range(3))
    return result
