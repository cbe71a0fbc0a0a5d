"""launcher=slurm: the job side of Slurm runs submitted by Hydra's submitit launcher.

    python -m workbench -m launcher=slurm hardware.nodes=2 hardware.procs=8 launcher.partition=gpu \
        train.checkpoint_every=200

Submission itself is Hydra's (conf/launcher/slurm.yaml selects `hydra/launcher=submitit_slurm` and
maps nodes, GPUs per node, time and partition onto it). Inside each Slurm task this module:
exports the torch.distributed variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) from submitit's job
environment, writes the launch record into the run dir (rank 0), and lets the runner train in
this process. Requeued after preemption, the job keeps its sweep subdir as output_dir, so
`train.resume=auto` continues from the last checkpoint there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from workbench.core.errors import UserError, missing_package
from workbench.guard import faults
from workbench.launch import network, remote


@dataclass
class Config:
    name: str = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_minutes: int = 240
    gpus_per_node: int = 1
    cpus_per_task: int = 8
    mem_gb: int | None = None
    max_requeues: int = 3
    constraint: str | None = None
    setup: list[str] = field(default_factory=list)


def in_slurm_job() -> bool:
    return os.environ.get("SUBMITIT_EXECUTOR") == "slurm" or (
        "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ)


def export_dist_env() -> dict:
    """Set torch.distributed's env:// variables for this Slurm task; return them."""
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        raise missing_package("submitit", "slurm") from None
    env = TorchDistributedEnvironment()
    if env.world_size > 1:
        # CUDA_VISIBLE_DEVICES is left alone: the runner picks cuda:LOCAL_RANK itself.
        env.export(set_cuda_visible_devices=False)
        # gloo/NCCL on the interface that reaches the job's first node, not whatever the hostname
        # resolves to (127.0.1.1 on a default Debian node)
        network.prepare(f"{env.master_addr}:{env.master_port}", field="the Slurm job's first node")
    return {"RANK": env.rank, "WORLD_SIZE": env.world_size, "LOCAL_RANK": env.local_rank,
            "MASTER_ADDR": env.master_addr, "MASTER_PORT": env.master_port}


def launch(cfg):
    lc = remote.launcher_config(Config, cfg)
    if not in_slurm_job():
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise missing_package("submitit", "slurm") from None
        raise UserError("launcher=slurm submits through Hydra's submitit launcher; add -m, e.g. "
                        "`python -m workbench -m launcher=slurm launcher.partition=<p> ...`")
    dist_env = export_dist_env()
    preempt_then_requeue()
    if dist_env["RANK"] == 0:
        spec = remote.job_spec(cfg, "slurm")
        spec["manifest"]["slurm"] = {k: os.environ.get(k) for k in (
            "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_JOB_NODELIST", "SLURM_RESTART_COUNT")}
        spec["manifest"]["slurm"]["partition"] = lc.partition
        spec["manifest"]["dist"] = dist_env
        remote.materialize(spec, cfg.output_dir)
    return None  # train here, as this Slurm task's rank


def preempt_then_requeue() -> None:
    """Slurm's warning ahead of a time limit or preemption (`--signal`; submitit asks for USR2)
    and a plain SIGTERM both reach the fault guard (workbench/guard/faults.py): the step finishes
    and every rank checkpoints together. Then rank 0 requeues the job, which comes back with the
    same output_dir and resumes there. submitit's own USR2 handler would requeue at once and exit
    without that checkpoint, so USR2 is turned into SIGTERM instead."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR2, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    faults.ON_PREEMPTED[:] = [_requeue]
    faults.ON_PEER_LOST[:] = [_requeue_lost]


def _requeue_lost(lost: tuple[int, ...], rank: int) -> None:
    """A node of the job lost mid-run: the surviving rank with the lowest number requeues the job.
    Slurm starts it again once it has the nodes (the lost one back, or another), and it resumes
    from the last intact checkpoint in the same output_dir. Without this the job would end FAILED
    as soon as the survivors stop, before Slurm has marked the node down (SlurmdTimeout)."""
    if rank != min(r for r in range(rank + 1) if r not in lost):
        return
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode == 0:
        print(f"requeued Slurm job {job}: rank(s) {', '.join(map(str, lost))} lost; it resumes from the last "
              "checkpoint when Slurm has its nodes again", file=sys.stderr, flush=True)
    else:
        print(f"warning: could not requeue Slurm job {job} after losing rank(s) {', '.join(map(str, lost))} "
              f"({done.stderr.strip()}); resubmit with the same output_dir to resume", file=sys.stderr, flush=True)


def _requeue(step: int, ckpt) -> None:
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_PROCID", "0") != "0":
        return
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode == 0:
        print(f"requeued Slurm job {job}: it resumes from step {step}", file=sys.stderr, flush=True)
    else:
        print(f"warning: could not requeue Slurm job {job} ({done.stderr.strip()}); resubmit with the same "
              "output_dir to resume", file=sys.stderr, flush=True)
