"""`python -m workbench.export <run_dir> step=N` re-exports a saved checkpoint, sharded ones
included (with the backend that wrote them, and on one process), and gets the same files as the
export at the end of the run that wrote it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_export_checkpoint.py -m "slow or not slow"
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
RUN = ["model=tiny", "precision=fp32", "eval=none", "train.max_steps=2", "train.micro_batch_size=2",
       "train.checkpoint_every=1", "export.parity_prompts=3", "optim.lr=1e-2"]


def _run(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _same_export(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    for sub in ("adapter/adapter_model.safetensors", "merged/model.safetensors"):
        x, y = load_file(str(a / sub)), load_file(str(b / sub))
        assert x.keys() == y.keys(), sub
        for k in x:
            assert torch.equal(x[k], y[k]), (sub, k)


@pytest.mark.distributed
@pytest.mark.parametrize("backend", [
    pytest.param(["backend=single"], id="single"),
    pytest.param(["backend=fsdp2", "hardware.procs=2"], id="fsdp2", marks=pytest.mark.slow),
    pytest.param(["backend=deepspeed", "backend.stage=3", "hardware.procs=2"], id="zero3", marks=pytest.mark.slow),
])
def test_checkpoint_export_equals_end_of_run_export(tmp_path, backend):
    run = tmp_path / "run"
    _run(["workbench", *RUN, *backend, f"output_dir={run}"])
    _run(["workbench.export", str(run), "step=2"])
    _same_export(run / "export", run / "exports" / "step-00000002" / "export")
    if backend != ["backend=single"]:  # any checkpoint exports on one process too (its canonical format)
        _run(["workbench.export", str(run), "step=2", "backend=single", "hardware.procs=1"])
        _same_export(run / "export", run / "exports" / "step-00000002" / "export")


def test_export_of_a_missing_step_is_one_error_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "config.yaml").write_text("{}\n")
    proc = subprocess.run([sys.executable, "-m", "workbench.export", str(tmp_path), "step=7"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr
