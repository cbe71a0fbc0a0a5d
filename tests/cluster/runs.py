"""What the cluster tests run on the nodes, and what they compare it with."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import train
from tests.helpers import ROOT, dist_env


def on(cluster, node: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
    """`python -m workbench ARGS` on `node` (stdout and stderr together)."""
    return cluster.popen(node, [sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env or dist_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def one_process_losses(out, steps: int) -> list[float]:
    """The tiny model's per-step losses in one process at the global batch of 2 ranks x 1
    micro-batch (test_backends.py: FSDP2 on 2 ranks equals it)."""
    return train(["peft=none", f"train.max_steps={steps}", "train.grad_accum=2"], out)["losses"]
