"""The workbench starting torchrun itself: elastic restart after a killed rank, and two agents on
loopback forming one 2-node job. Real `python -m workbench` processes, CPU and gloo.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_launch_torchrun.py

Both compare against an uninterrupted backend=single run at the same global batch, in this
process (test_backends.py shows FSDP2 with 2 ranks equals it).
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY, train
from tests.helpers import finish, free_port, logged_losses, workbench
from tests.tolerances import LOSS_RTOL

pytestmark = pytest.mark.distributed
RUN = [*TINY, "backend=fsdp2", "peft=none", "train.max_steps=3", "++hardware.timeout_minutes=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    return train(["peft=none", "train.max_steps=3", "train.grad_accum=2"], out)["losses"]


def test_killed_rank_restarts_and_finishes_with_the_same_loss(tmp_path, reference):
    log = finish(workbench([*RUN, "hardware.procs=2", "++hardware.max_restarts=1", "train.checkpoint_every=1",
                            "debug.crash_at_step=2", "debug.crash_rank=1", f"output_dir={tmp_path}"]))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    # A fresh output_dir has nothing to resume from: only a restarted attempt can have resumed.
    assert manifest["resumed_from"].endswith("step-00000002"), log[-2000:]
    got = logged_losses(tmp_path)
    assert got == pytest.approx(reference, rel=LOSS_RTOL)  # 2 ranks vs 1: tests/tolerances.py


@pytest.mark.slow  # two nodes' agents: the cluster tier runs them on two nodes (tests/cluster/test_torchrun_nodes.py)
def test_two_agents_on_loopback_form_one_job(tmp_path, reference):
    endpoint = f"127.0.0.1:{free_port()}"
    args = [*RUN, "train.max_steps=2", "hardware.procs=1", "hardware.nodes=2",
            f"++hardware.rdzv_endpoint={endpoint}", f"output_dir={tmp_path}"]
    agents = [workbench(args), workbench(args)]
    for a in agents:
        finish(a)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert logged_losses(tmp_path) == pytest.approx(reference[:2], rel=LOSS_RTOL)  # same global batch, same curve


def test_a_mistake_met_by_a_rank_stops_the_job_without_using_the_restarts(tmp_path):
    # NaN at step 1 with no skips allowed stops the run with a UserError (workbench/guard/faults.py);
    # a restart would resume from nothing and meet the same NaN, so the launcher stops at once
    proc = workbench([*RUN, "precision=fp32", "hardware.procs=2", "++hardware.max_restarts=2",
                      "debug.nan_at_step=1", f"output_dir={tmp_path}"])
    out, _ = proc.communicate(timeout=600)
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, out[-4000:]
    assert "restart 1 of 2" not in out
    assert errors[0].startswith("error: rank ") and "the same on every restart" in errors[0], errors[0]
    assert "NaN" in errors[0] or "nan" in errors[0].lower(), errors[0]
