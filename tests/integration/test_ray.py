"""launcher=ray for real: a local Ray cluster, Ray Train's TorchTrainer with 2 CPU workers (gloo)
on the tiny model; rank 1 is killed mid-run and the restarted group resumes from the checkpoint.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_ray.py
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import compose, train
from tests.tolerances import LOSS_RTOL

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

# The slow tier (a Ray cluster's start and a killed worker: over 3 min on 2 cores); the cluster
# tier runs Ray across two nodes (tests/cluster/test_ray_nodes.py).
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster():
    # One small cluster for the module: Ray's startup is the slow part. Ray's memory monitor
    # kills workers when the *machine* is near its limit; on a shared test box other jobs' memory
    # would kill ours, so it is off for this cluster.
    before = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    if before is None:
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
    else:
        os.environ["RAY_memory_monitor_refresh_ms"] = before


def test_two_workers_train_and_resume_after_a_worker_is_killed(cluster, tmp_path):
    from workbench.launch import ray_train

    cfg = compose(["launcher=ray", "hardware.procs=2", "train.max_steps=4", "train.checkpoint_every=2",
                   "debug.crash_at_step=2", "debug.crash_rank=1", "launcher.max_failures=1"], tmp_path / "ray")
    results = ray_train.launch(cfg)

    run = tmp_path / "ray"
    # attempt 1 ran steps 1-2, checkpointed, then rank 1 died (os._exit(17)); attempt 2 resumed
    assert (run / "launch" / "ray_attempts.rank1").read_text().count("\n") == 2
    assert results["resumed_from"].endswith("step-00000002")
    assert (run / "ray").is_dir() and results["ray"]["storage_path"] == str(run / "ray")  # RunConfig(storage_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert len(results["losses"]) == 2  # only the steps after the resume ran in attempt 2
    assert json.loads((run / "launch" / "launch.json").read_text())["launcher"] == "ray"

    # 2 ranks x 4 examples == 1 rank with 2 x 4 accumulated: the same loss curve, crash and all
    ref = train(["train.max_steps=4", "train.grad_accum=2"], tmp_path / "ref")
    # only the order of the gradient reduction differs (tests/tolerances.py)
    assert [r["loss"] for r in rows] == pytest.approx(ref["losses"], rel=LOSS_RTOL)
