"""`launcher=slurm` submitting for real: slurmctld and a slurmd per node (tests/cluster/slurm.py),
Hydra's submitit launcher calling sbatch on n1, a 2-node job whose tasks join over the nodes'
own interfaces, a 2-job multirun with its sweep summary, and preemption as Slurm does it: a
signal, a checkpoint, a requeue, a resume.

    .venv/bin/python -m pytest -q -m cluster tests/cluster/test_slurm_nodes.py
"""

from __future__ import annotations

import json
import time

import pytest

from tests.cluster import slurm as slurm_harness
from tests.cluster.runs import on, one_process_losses
from tests.conftest import TINY
from tests.helpers import dist_env, logged_losses
from tests.tolerances import LOSS_RTOL

JOB = [*TINY, "backend=fsdp2", "peft=none", "hardware.nodes=2", "hardware.procs=1", "launcher=slurm",
       "launcher.cpus_per_task=1", "launcher.gpus_per_node=0", "launcher.time_minutes=10", "++hardware.timeout_minutes=4"]


@pytest.fixture(scope="module")
def slurm(cluster, tmp_path_factory):
    why = slurm_harness.unavailable()
    if why:
        pytest.skip(why)
    s = slurm_harness.Slurm(cluster, tmp_path_factory.mktemp("slurm")).start()
    yield s
    s.stop()


def reference(tmp_path, steps: int) -> list[float]:
    return one_process_losses(tmp_path / f"ref{steps}", steps)


def submit(slurm, args: list[str], sweep_dir):
    """`python -m workbench -m launcher=slurm ...` on n1, the login node; it exits when every job has."""
    return on(slurm.cluster, "n1", ["-m", *JOB, *args, f"hydra.sweep.dir={sweep_dir}"],
              env={**dist_env(), "SLURM_CONF": slurm.env["SLURM_CONF"]})


def test_a_two_job_multirun_of_two_node_jobs_ends_with_one_process_losses(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    proc = submit(slurm, ["train.max_steps=3,2"], sweep)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-4000:] + slurm.logs()
    for job, steps in ((0, 3), (1, 2)):
        manifest = json.loads((sweep / str(job) / "manifest.json").read_text())
        launch = json.loads((sweep / str(job) / "launch" / "launch.json").read_text())  # rank 0's record
        assert manifest["world_size"] == 2 and launch["slurm"]["SLURM_JOB_NODELIST"] == "n[1-2]", launch
        assert logged_losses(sweep / str(job)) == pytest.approx(reference(tmp_path, steps), rel=LOSS_RTOL)
    summary = (sweep / "sweep_summary.md").read_text()
    assert "2 jobs" in summary and "| 0 | 3 | 3 |" in summary and "| 1 | 2 | 2 |" in summary, summary
    assert summary.count("COMPLETED") == 2, summary


def test_a_preempted_job_checkpoints_requeues_and_resumes_with_the_same_losses(slurm, tmp_path):
    sweep, steps = tmp_path / "sweep", 8
    proc = submit(slurm, [f"train.max_steps={steps}", "debug.step_sleep_s=1", "train.checkpoint_every=100"], sweep)
    metrics, deadline, job = sweep / "0" / "metrics.jsonl", time.monotonic() + 300, None
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and sum('"loss"' in x for x in metrics.read_text().splitlines()) >= 3:
            job = slurm.client(["squeue", "-h", "-o", "%i"]).stdout.split()[0]
            # what Slurm sends ahead of a time limit or a preemption (submitit's --signal=USR2@...)
            assert slurm.client(["scancel", "--signal=USR2", job]).returncode == 0
            break
        time.sleep(0.2)
    out = proc.communicate(timeout=600)[0]
    assert job and proc.returncode == 0, out[-4000:] + slurm.logs()
    logs = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_0_log.err"))
    assert f"requeued Slurm job {job}" in logs, logs[-4000:]
    manifest = json.loads((sweep / "0" / "manifest.json").read_text())
    assert manifest["resumed_from"] and 3 <= int(manifest["resumed_from"].rsplit("-", 1)[1]) < steps, manifest
    launch = json.loads((sweep / "0" / "launch" / "launch.json").read_text())  # the requeued attempt's record
    assert launch["slurm"]["SLURM_RESTART_COUNT"] == "1", launch["slurm"]
    assert logged_losses(sweep / "0") == pytest.approx(reference(tmp_path, steps), rel=LOSS_RTOL)
