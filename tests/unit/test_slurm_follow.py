"""Following Slurm jobs without accounting (workbench/launch/slurm_follow.py), offline: sacct,
squeue and scontrol answered by a stand-in, as a cluster without slurmdbd answers them.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_slurm_follow.py

The whole path (a real Slurm, a job whose processes die at start) is in
tests/cluster/test_slurm_nodes.py.
"""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from workbench.launch import slurm_follow, sweep
from workbench.launch.slurm_follow import Follower

pytest.importorskip("submitit")


class Cluster:
    """What sacct, squeue and scontrol print for the jobs in `queue` (id -> state) and `left`
    (id -> scontrol's line for a job that has left the queue); `calls` counts each command."""

    def __init__(self, accounting: bool = False):
        self.accounting, self.queue, self.left, self.calls = accounting, {}, {}, []

    def __call__(self, argv, **kw):
        self.calls.append(argv[0])
        if argv[0] == "sacct":
            if not self.accounting:
                return subprocess.CompletedProcess(argv, 1, "", "sacct: error: Slurm accounting storage is disabled\n")
            rows = "".join(f"{j}|{s}|0:0|n1\n" for j, s in self.queue.items())
            return subprocess.CompletedProcess(argv, 0, "JobID|State|ExitCode|NodeList\n" + rows, "")
        if argv[0] == "squeue":
            return subprocess.CompletedProcess(argv, 0, "".join(f"{j}|{s}|n[1-2]\n" for j, s in self.queue.items()), "")
        job = argv[-1]
        lines = [line for j, line in self.left.items() if j.split("_")[0] == job]
        if not lines:
            return subprocess.CompletedProcess(argv, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        return subprocess.CompletedProcess(argv, 0, "\n".join(lines) + "\n", "")


def test_without_accounting_a_job_is_followed_through_squeue_then_scontrol_and_said_once(capsys):
    cluster = Cluster(accounting=False)
    follower = Follower(poll_s=0, run=cluster)
    cluster.queue = {"12_0": "RUNNING", "12_1": "PENDING"}
    for job in cluster.queue:
        follower.register_job(job)
    assert follower.get_state("12_0") == "RUNNING" and not follower.is_done("12_1")
    # job 0's processes die at start: it leaves the queue; scontrol keeps it for MinJobAge
    del cluster.queue["12_0"]
    cluster.left["12_0"] = "JobId=13 ArrayJobId=12 ArrayTaskId=0 JobState=FAILED Reason=NonZeroExitCode ExitCode=13:0"
    assert follower.is_done("12_0") and follower.get_info("12_0")["ExitCode"] == "13:0"
    assert not follower.is_done("12_1")
    for _ in range(3):
        follower.update()
    warned = capsys.readouterr().err
    # one warning for the whole launch, not one per poll; sacct asked once
    assert warned.count("warning: Slurm accounting (sacct) is not available here") == 1, warned
    assert "accounting storage is disabled" in warned and cluster.calls.count("sacct") == 1


def test_an_ended_job_is_asked_about_no_more_and_a_forgotten_one_is_lost_after_the_budget(monkeypatch):
    cluster = Cluster(accounting=False)
    clock = [100.0]
    monkeypatch.setattr(slurm_follow.time, "monotonic", lambda: clock[0])
    follower = Follower(poll_s=0, budget_s=60, run=cluster)
    follower.register_job("7")
    follower.register_job("8")
    cluster.left["7"] = "JobId=7 JobState=COMPLETED Reason=None ExitCode=0:0"
    follower.update()
    assert follower.is_done("7", mode="cache") and not follower.is_done("8", mode="cache")
    calls = len(cluster.calls)
    follower.get_info("7")  # ended: no more commands for it
    assert len(cluster.calls) == calls
    clock[0] += 59
    assert not follower.is_done("8")  # unknown to squeue and scontrol, inside the budget
    clock[0] += 2
    assert follower.get_state("8") == "LOST" and follower.is_done("8", mode="cache")
    assert "60 s" in follower.get_info("8", mode="cache")["Reason"]


def test_with_accounting_sacct_answers_and_nothing_is_lost(monkeypatch, capsys):
    cluster = Cluster(accounting=True)
    follower = Follower(poll_s=0, budget_s=0, run=cluster)
    cluster.queue = {"5_0": "RUNNING"}
    follower.register_job("5_0")
    follower.register_job("5_1")  # sacct does not list it yet: no accounting answer is not a loss
    assert follower.get_state("5_0") == "RUNNING" and follower.get_state("5_1") == "UNKNOWN"
    cluster.queue = {"5_0": "CANCELLED by 0"}
    assert follower.is_done("5_0")
    # states come from sacct alone (squeue is asked only for held, requeued jobs)
    assert "scontrol" not in cluster.calls and capsys.readouterr().err == ""


def test_a_requeued_job_held_for_its_begin_time_is_released_once_per_requeue(capsys, monkeypatch):
    """Slurm holds a requeued job about two minutes (Reason=BeginTime): the follower sets its begin
    time to now once it has been held KillWait + RELEASE_MARGIN_S (the requeued instance's srun
    is gone by then), once per requeue; a job never requeued keeps the begin time its user asked for."""
    clock = [100.0]
    monkeypatch.setattr(slurm_follow.time, "monotonic", lambda: clock[0])
    calls = []
    restarts = {"21_0": 1, "22": 0}

    def run(argv, **kw):
        calls.append(argv)
        if argv[0] == "squeue" and "PENDING" in argv:
            return subprocess.CompletedProcess(argv, 0, "21_0|BeginTime\n22|BeginTime\n23|Priority\n", "")
        if argv[:3] == ["scontrol", "show", "config"]:
            return subprocess.CompletedProcess(argv, 0, "InactiveLimit           = 0 sec\nKillWait                = 5 sec\n", "")
        if argv[:2] == ["scontrol", "show"]:
            return subprocess.CompletedProcess(argv, 0, f"JobId={argv[-1]} JobState=PENDING Reason=BeginTime "
                                                        f"Restarts={restarts.get(argv[-1], 0)}\n", "")
        if argv[:2] == ["scontrol", "update"]:
            return subprocess.CompletedProcess(argv, 0, "", "")
        return subprocess.CompletedProcess(argv, 0, "", "")  # sacct: nothing listed yet

    follower = Follower(poll_s=0, run=run)
    for job in ("21_0", "22", "23"):
        follower.register_job(job)
    follower.update()
    assert follower.release_after() == 5 + slurm_follow.RELEASE_MARGIN_S  # KillWait from scontrol show config
    clock[0] += 14.9
    follower.update()
    assert not [a for a in calls if a[:2] == ["scontrol", "update"]]  # held for less than 15 s: not yet
    clock[0] += 0.2
    for _ in range(3):
        follower.update()
    updates = [a for a in calls if a[:2] == ["scontrol", "update"]]
    assert updates == [["scontrol", "update", "JobId=21_0", "StartTime=now"]]  # once; not 22 (never requeued)
    assert capsys.readouterr().err.count("Slurm job 21_0 was requeued: its begin time is set to now") == 1
    restarts["21_0"] = 2  # requeued again: released again, after its own wait
    follower.update()
    clock[0] += 15.1
    follower.update()
    assert len([a for a in calls if a[:2] == ["scontrol", "update"]]) == 2


def test_a_job_that_ended_without_a_result_is_one_line_and_a_failed_job_of_the_summary(tmp_path):
    err = tmp_path / "12_0_0_log.err"
    err.write_text("srun: error: n1: task 0: Exited with exit code 13\n"
                   "slurmstepd: error: execve(): /opt/venv/bin/python: Permission denied\n\n")
    job = SimpleNamespace(job_id="12_0", paths=SimpleNamespace(stderr=err, stdout=tmp_path / "none.out"))
    info = {"State": "FAILED", "ExitCode": "13:0", "Reason": "NonZeroExitCode"}
    line = slurm_follow.ended_line(job, RuntimeError("has not produced any output"), info)
    assert line == (f"Slurm job 12_0 ended FAILED exit 13:0 NonZeroExitCode before it wrote a result: slurmstepd: "
                    f"error: execve(): /opt/venv/bin/python: Permission denied (log: {err})"), line
    sweep_dir = tmp_path / "sweep"
    sweep.record_lost_job(sweep_dir / "0", ["optim.lr=1e-4"], line)
    written = sweep.summarize(sweep_dir, plot=False)
    assert written["failed"] == [0]
    summary = (sweep_dir / "sweep_summary.md").read_text()
    assert "FAILED" in summary and "execve(): /opt/venv/bin/python: Permission denied" in summary, summary
    assert json.loads((sweep_dir / "0" / sweep.JOB_FILE).read_text())["status"] == "FAILED"
