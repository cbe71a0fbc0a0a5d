"""The submitting side of launcher=slurm: submit a sweep's jobs and follow them to their end, on
clusters with Slurm accounting and without it.

    python -m workbench -m launcher=slurm hardware.nodes=2 train.max_steps=100,200

Hydra's submitit launcher waits for each job through `sacct`. Many small clusters keep no
accounting (no slurmdbd): there sacct fails on every poll, submitit logs "Bypassing sacct error"
each time, and a job that dies before it writes a result is waited for forever. Here:

- `Follower` answers what submitit's jobs ask their watcher from `sacct` where it works, else
  (said once) from `squeue` while a job is queued or running and `scontrol show job` once it has
  left the queue (Slurm keeps it there for MinJobAge, 300 s by default). A job that neither
  knows for `BUDGET_S` is LOST;
- `launch` submits as Hydra's launcher does, then collects the jobs: one that ended without a
  result (its processes never started, a node failed, scancel) becomes a FAILED job of the sweep
  with the last line of its error stream and the path of that log, and the sweep goes on;
  the sweep summary lists it, and the command exits 2 at the end (workbench/cli.py);
- a job requeued mid-run (a node lost or a preemption: workbench/launch/slurm.py) is held by
  Slurm for about two minutes before it may start again (Reason=BeginTime); `Follower` sets its
  begin time to now, once per requeue, so it starts as soon as it has its nodes.

hydra_plugins/workbench_slurm/ registers the launcher with Hydra; conf/launcher/slurm.yaml picks it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from workbench.launch import sweep

POLL_S = 10.0    # between two looks at the queue: a job's end is seen within this
BUDGET_S = 60.0  # a job that neither squeue nor scontrol knows for this long is LOST
# a requeued job is released this long after Slurm's KillWait: the requeued instance's srun waits
# KillWait + 2 s for its step before it cancels it (measured in the cluster tier)
RELEASE_MARGIN_S = 10.0
# What sacct/squeue/scontrol call a job that has not ended (submitit's list and Slurm's others)
NOT_ENDED = {"READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "CONFIGURING",
             "SUSPENDED", "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT"}


class Follower:
    """The watcher submitit's Slurm jobs consult (`register_job`, `get_info`, `get_state`,
    `is_done`: the methods its Job calls), shared by all the jobs of one launch."""

    def __init__(self, poll_s: float = POLL_S, budget_s: float = BUDGET_S, run=subprocess.run,
                 release_after_s: float | None = None):
        """`release_after_s`: how long a requeued job stays held before its begin time is set to now
        (None: Slurm's KillWait + RELEASE_MARGIN_S, read from `scontrol show config`)."""
        self.poll_s, self.budget_s, self.run, self.release_after_s = poll_s, budget_s, run, release_after_s
        self.info: dict[str, dict] = {}     # job id ("12_0", "12") -> its latest State, ExitCode, Reason
        self.ended: set[str] = set()
        self.unseen: dict[str, float] = {}  # job id -> when neither squeue nor scontrol first lacked it
        self.accounting: bool | None = None  # sacct answers; None until asked
        self.last = float("-inf")
        self.released: dict[str, int] = {}  # job id -> the requeue (Restarts) whose hold was lifted
        self.held: dict[tuple[str, int], float] = {}  # (job id, Restarts) -> when first seen held

    def register_job(self, job_id: str) -> None:
        self.info.setdefault(job_id, {})
        self.last = float("-inf")  # look at once: a job may die within seconds

    def get_info(self, job_id: str, mode: str = "standard") -> dict:
        due = mode == "force" or (mode == "standard" and time.monotonic() - self.last >= self.poll_s)
        if due and job_id not in self.ended:
            self.update()
        return self.info.get(job_id, {})

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode).get("State") or "UNKNOWN"

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        return _ended(self.get_state(job_id, mode))

    def update(self) -> None:
        self.last = time.monotonic()
        open_ = [j for j in self.info if j not in self.ended]
        if not open_:
            return
        bases = sorted({j.split("_")[0] for j in open_})
        self._release_requeued(bases)
        found = self._sacct(bases) if self.accounting is not False else None
        if found is None:
            found = self._queue(bases)
        for job in open_:
            if job in found:
                self.info[job] = found[job]
                self.unseen.pop(job, None)
            elif self.accounting is False:  # sacct would know an ended job; squeue/scontrol forget it
                first = self.unseen.setdefault(job, self.last)
                if self.last - first >= self.budget_s:
                    self.info[job] = {"State": "LOST", "Reason": f"neither squeue nor scontrol has known it "
                                                                f"for {self.budget_s:.0f} s"}
            if _ended(self.info[job].get("State", "UNKNOWN")):
                self.ended.add(job)

    def _sacct(self, bases: list[str]) -> dict | None:
        """sacct's view of the jobs, or None (once said) where the cluster keeps no accounting."""
        done = self._call(["sacct", "-o", "JobID,State,ExitCode,NodeList", "--parsable2",
                           *(x for b in bases for x in ("-j", b))])
        if done is None or done.returncode != 0:
            self.accounting = False
            why = (done.stderr.strip().splitlines() or ["no answer"])[0] if done is not None else "sacct not found"
            print(f"warning: Slurm accounting (sacct) is not available here ({why}); following the jobs with "
                  "squeue and scontrol instead", file=sys.stderr, flush=True)
            return None
        self.accounting = True
        from submitit.slurm.slurm import SlurmInfoWatcher  # its parser of sacct's table, array ids included

        return SlurmInfoWatcher().read_info(done.stdout)

    def _queue(self, bases: list[str]) -> dict:
        """squeue for the jobs still queued or running, scontrol for those that have left."""
        found: dict[str, dict] = {}
        done = self._call(["squeue", "-h", "-r", "-o", "%i|%T|%N"])
        for line in (done.stdout if done is not None and done.returncode == 0 else "").splitlines():
            job, _, rest = line.strip().partition("|")
            if job.split("_")[0] in bases:
                state, _, nodes = rest.partition("|")
                found[job] = {"State": state, "NodeList": nodes}
        for base in bases:
            done = self._call(["scontrol", "show", "job", "-o", base])
            for line in (done.stdout if done is not None and done.returncode == 0 else "").splitlines():
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                task = fields.get("ArrayTaskId")
                job = f"{fields.get('ArrayJobId')}_{task}" if task and task.isdigit() else fields.get("JobId")
                if job and job not in found:  # squeue's word wins while the job is in the queue
                    found[job] = {"State": fields.get("JobState", "UNKNOWN"), "ExitCode": fields.get("ExitCode"),
                                  "Reason": fields.get("Reason"), "NodeList": fields.get("NodeList")}
        return found

    def _release_requeued(self, bases: list[str]) -> None:
        """A requeued job waits for its begin time (Slurm sets it about two minutes ahead) although
        all it needs is nodes: set it to now, once per requeue. A job never requeued (Restarts=0)
        keeps the begin time its user asked for (sbatch --begin). Not at once: the requeued
        instance's srun lingers up to KillWait after the requeue, and cancelling its step then
        would cancel the new instance's step of the same id; so the hold is lifted once the job
        has been seen held for `release_after()` seconds."""
        done = self._call(["squeue", "-h", "-r", "-t", "PENDING", "-o", "%i|%r"])
        for line in (done.stdout if done is not None and done.returncode == 0 else "").splitlines():
            job, _, reason = line.strip().partition("|")
            if job.split("_")[0] not in bases or reason != "BeginTime":
                continue
            shown = self._call(["scontrol", "show", "job", "-o", job])
            fields = dict(f.split("=", 1) for f in (shown.stdout if shown is not None else "").split() if "=" in f)
            restarts = int(fields.get("Restarts", "0") or 0)
            if restarts == 0 or self.released.get(job) == restarts:
                continue
            first = self.held.setdefault((job, restarts), time.monotonic())
            if time.monotonic() - first < self.release_after():
                continue
            self.released[job] = restarts
            moved = self._call(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            if moved is not None and moved.returncode == 0:
                print(f"Slurm job {job} was requeued: its begin time is set to now, so it starts again as soon as "
                      "it has its nodes", file=sys.stderr, flush=True)

    def release_after(self) -> float:
        if self.release_after_s is None:
            done = self._call(["scontrol", "show", "config"])
            kill_wait = next((line.split("=", 1)[1].split()[0] for line in (done.stdout if done is not None else "")
                              .splitlines() if line.replace(" ", "").startswith("KillWait=")), "30")
            self.release_after_s = float(kill_wait) + RELEASE_MARGIN_S if kill_wait.isdigit() else 30 + RELEASE_MARGIN_S
        return self.release_after_s

    def _call(self, argv: list[str]):
        try:
            return self.run(argv, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None


def _ended(state: str) -> bool:
    return (state.split() or ["UNKNOWN"])[0].upper() not in NOT_ENDED  # "CANCELLED by 0"


def ended_line(job, error: BaseException, info: dict) -> str:
    """One line for a job that ended without a result: its state and exit code, the last line of
    its error stream (else of its output), and where that log is."""
    state = " ".join(x for x in (info.get("State"), f"exit {info['ExitCode']}" if info.get("ExitCode") else "",
                                 info.get("Reason") if info.get("Reason") not in (None, "None") else "") if x)
    last, where = "", ""
    for path in (job.paths.stderr, job.paths.stdout):
        try:
            lines = [x.strip() for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            continue
        if lines:
            last, where = lines[-1], str(path)
            break
    said = f": {last}" if last else f": {' '.join(str(error).split())[:300]}"
    log = f" (log: {where})" if where else ""
    return f"Slurm job {job.job_id} ended {state or 'without a state'} before it wrote a result{said}{log}"


def launch(inner, job_overrides, initial_job_idx: int):
    """Hydra's submitit launch (hydra_submitit_launcher's `launch`: its executor, its parameters,
    `inner` as the pickled callable each job runs), then this module's collection of the jobs."""
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import JobReturn, JobStatus, filter_overrides
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf
    from submitit.slurm.slurm import SlurmJob

    params = dict(inner.params)
    executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                     slurm_max_num_timeout=params.pop("max_num_timeout"))
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    sweep_dir = Path(str(inner.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in inner.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(inner.config.hydra.sweep.mode), 8))
    print(f"submitting {len(job_overrides)} job(s) to Slurm; sweep dir {sweep_dir}", file=sys.stderr, flush=True)
    args = []
    for idx, overrides in enumerate(job_overrides, initial_job_idx):
        print(f"  #{idx}: {' '.join(filter_overrides(overrides))}", file=sys.stderr, flush=True)
        args.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))

    follower, shared = Follower(), SlurmJob.watcher
    SlurmJob.watcher = follower  # the jobs (and their tasks) register with it as they are made
    try:
        jobs = executor.map_array(inner, *zip(*args))
        returns = []
        for (overrides, _, idx, _, _), job in zip(args, jobs, strict=True):
            try:
                returns.append(job.results()[0])
            except submitit.core.utils.UncompletedJobError as e:  # FailedJobError too: no result
                line = ended_line(job, e, follower.info.get(job.job_id, {}))
                print(f"error: sweep job {idx}: {line}", file=sys.stderr, flush=True)
                sweep.record_lost_job(_job_dir(inner, overrides, idx), overrides, line)
                sweep.FAILED_JOBS.append(f"job {idx}: {line}")
                sweep.SUMMARY[:] = [str(sweep_dir / "sweep_summary.md")]
                # COMPLETED with no value, as a job that failed inside the CLI returns: Hydra's
                # sweeper re-raises a FAILED return's error, which would end the sweep here
                returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=None))
        return returns
    finally:
        SlurmJob.watcher = shared


def _job_dir(inner, overrides, idx: int) -> Path:
    """The job's Hydra dir (hydra.sweep.dir / hydra.sweep.subdir), as the job itself would resolve it."""
    from omegaconf import open_dict

    cfg = inner.hydra_context.config_loader.load_sweep_config(inner.config, list(overrides))
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = idx
    return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
