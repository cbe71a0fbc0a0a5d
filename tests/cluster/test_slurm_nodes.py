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

from tests.cluster import recovery
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


def test_a_job_that_dies_at_start_is_reported_within_the_budget_and_the_sweep_goes_on(slurm, tmp_path):
    """This Slurm keeps no accounting (sacct fails, as on many small clusters): job 0's processes
    never start (its batch script exits 13 before srun, as when the nodes cannot execute the
    submitter's Python); job 1 trains. The submitter names job 0's error within BUDGET_S of its
    death, says the sacct warning once, lists job 0 FAILED in the summary and exits 2."""
    from workbench.launch.slurm_follow import BUDGET_S

    sweep = tmp_path / "sweep"
    die = tmp_path / "die_first.sh"
    die.write_text('if [ "$SLURM_ARRAY_TASK_ID" = 0 ]; then\n'
                   '  echo "slurmstepd: error: execve(): python: Permission denied" >&2; exit 13\nfi\n')
    proc = submit(slurm, ["train.max_steps=2,3", f"launcher.setup=['. {die}']"], sweep)
    said, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if said is None and line.startswith("error: sweep job 0:"):
            said = time.time()
    proc.wait(timeout=60)
    out = "".join(lines)
    assert proc.returncode == 2 and said is not None, out[-4000:] + slurm.logs()
    err = next(sweep.glob(".submitit/*_0/*_0_0_log.err"))
    waited = said - err.stat().st_mtime  # from the job's last word to the submitter's
    print(f"\na job dead at start: reported {waited:.0f} s after it died")
    assert waited <= BUDGET_S, out
    assert "execve(): python: Permission denied" in out and "ended FAILED exit 13:0" in out, out
    assert out.count("Slurm accounting (sacct) is not available here") == 1, out
    summary = (sweep / "sweep_summary.md").read_text()
    assert "2 jobs, 1 failed" in summary and "Permission denied" in summary, summary
    assert summary.count("COMPLETED") == 1 and "| 1 | 3 | 3 |" in summary, summary


def test_a_node_lost_mid_job_requeues_it_and_it_finishes_with_the_same_losses(slurm, tmp_path):
    """n2 lost at step 3 (its slurmd and the job's processes killed, as when the machine goes): rank
    0 names the lost rank and requeues the job; Slurm marks n2 not responding (SlurmdTimeout=30);
    n2's slurmd comes back, the node returns to service and the job runs again on both nodes,
    resuming from the last checkpoint, and ends with one process's losses."""
    sweep, steps = tmp_path / "sweep", 8
    proc = submit(slurm, [f"train.max_steps={steps}", "debug.step_sleep_s=1", "train.checkpoint_every=1"], sweep)
    metrics = sweep / "0" / "metrics.jsonl"
    logged = lambda: sum('"loss"' in x for x in metrics.read_text().splitlines()) if metrics.exists() else 0  # noqa: E731
    rank0 = lambda: "".join(p.read_text(errors="replace") for p in (sweep / ".submitit").glob("*/*_0_log.err"))  # noqa: E731
    killed = _until(lambda: logged() >= 3 and time.monotonic(), 300, proc)
    assert killed, proc.communicate(timeout=60)[0][-4000:] + slurm.logs()
    slurm.cluster.kill("n2")
    at = logged()
    named = _until(lambda: "rank(s) 1 lost" in rank0() and time.monotonic(), 120, proc)
    noticed = _until(lambda: ("*" in slurm.state("n2") or "down" in slurm.state("n2")) and time.monotonic(), 150, proc)
    state = slurm.state("n2")
    slurm.start_slurmd("n2")  # the node comes back
    training = _until(lambda: logged() > at and time.monotonic(), 300, proc)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0 and named and noticed, out[-4000:] + rank0()[-3000:] + slurm.logs()
    assert "rank(s) 1 stopped answering (its node closed the connection): rank 1 on n2" in rank0(), rank0()[-4000:]
    manifest = json.loads((sweep / "0" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["resumed_from"], manifest
    assert manifest["resume"]["certificate"]["ok"], manifest["resume"]
    losses, ref = logged_losses(sweep / "0"), reference(tmp_path, steps)
    assert losses == pytest.approx(ref, rel=LOSS_RTOL)
    seen = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]
    print(f"\nnode lost under Slurm: named after {named - killed:.0f} s, n2 {state!r} after {noticed - killed:.0f} s, "
          f"training again {training - killed:.0f} s after the loss")
    recovery.record("node killed mid-job (slurmd and processes; back after Slurm marked it)", "slurm",
                    named=named - killed, training=training - killed, steps_lost=len(seen) - len(set(seen)),
                    final=(losses[-1], ref[-1]), marked_by_slurm=noticed - killed)


def _until(what, timeout: float, proc):
    """`what()` once it is truthy, polled every second for `timeout` s or until `proc` ends; else None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = what()
        if found:
            return found
        time.sleep(1)
    return None
