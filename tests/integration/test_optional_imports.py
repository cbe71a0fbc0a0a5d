"""Optional engines are imported only when a run chooses them.

A `backend=single` run with evaluation before and after training and the merged export, on the
tiny model, in a fresh interpreter (this test process may have imported anything): afterwards
none of the optional engines may be in sys.modules. transformers' save_pretrained used to pull
DeepSpeed in through accelerate (and DeepSpeed printed its accelerator warning).

    .venv/bin/python -m pytest -q tests/integration/test_optional_imports.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("deepspeed", "megatron", "ray", "vllm", "unsloth", "liger_kernel", "wandb", "mlflow", "trackio",
           "modal", "runpod", "submitit", "lm_eval")

DRIVER = """
import json, sys
from tests.conftest import compose
from workbench.run.runner import Runner
cfg = compose(["eval=arith", "eval.num_samples=4", "eval.batch_size=4", "train.max_steps=2", "train.export=true",
               "train.resume=never"], out=sys.argv[1])
res = Runner(cfg).train()
assert "merged" in res["export"], res.get("export")
json.dump(sorted(m for m in sys.modules if m.split(".")[0] in sys.argv[3].split(",")), open(sys.argv[2], "w"))
"""


def test_single_run_with_eval_and_export_imports_no_engine(tmp_path):
    found = tmp_path / "modules.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "run"), str(found), ",".join(ENGINES)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(found.read_text()) == []
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr


LAUNCH = """
import gc, json, runpy, sys
out, found = sys.argv[1:3]
sys.argv = ["workbench", "model=tiny", "eval=none", "train.max_steps=2", "train.export=false", "train.resume=never",
            "output_dir=" + out]
runpy.run_module("workbench", run_name="__main__")
seen = {"modules": sorted(m for m in sys.modules if m.split(".")[0] in ("scipy", "boto3")),
        "gc_enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
import scipy.optimize  # hidden only while transformers and tensorboard were imported: importable again now
json.dump(seen, open(found, "w"))
"""


def test_cli_launch_skips_incidental_imports_and_restores_the_collector(tmp_path):
    """`python -m workbench` imports transformers' modelling code and tensorboard without scipy or
    boto3 (workbench/core/imports.py INCIDENTAL) and pauses the garbage collector during start-up
    (workbench/core/startup.py); after the job the collector is on again with nothing left frozen."""
    found = tmp_path / "found.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", LAUNCH, str(tmp_path / "run"), str(found)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2
    assert json.loads(found.read_text()) == {"modules": [], "gc_enabled": True, "frozen": 0}
