"""A real Slurm on the local cluster's nodes: `slurmctld` on n1, one `slurmd` per node, munge.

    apt-get install -y slurm-wlm munge                          # Debian's Slurm 22.05 (.ci/run does this)
    python scripts/local_cluster.py up --nodes 2 --slurm        # by hand; then:
    python scripts/local_cluster.py exec n1 -- srun -N2 hostname

Slurm is configured in a directory of its own (SLURM_CONF points there), so the machine's
/etc/slurm is not read or written. What this needed, and why:
- slurmctld starts only where the hostname equals `SlurmctldHost`: it runs on n1, in n1's UTS
  namespace (tests/cluster/nodes.py gives every command its node's hostname).
- slurmd needs cgroup controllers it can mount: each runs in its own mount namespace with a tmpfs
  on /sys/fs/cgroup and the v1 freezer, cpuset, memory and devices hierarchies mounted there,
  and `CgroupPlugin=cgroup/v1` (the host's hybrid layout is refused otherwise).
- `CPUs` must equal what slurmd finds on the machine; each node gets its own spool directory.
- munged's socket is a file, so one munged (in the root namespace) serves every node.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from tests.cluster.nodes import Cluster

PACKAGES = ("slurmctld", "slurmd", "sbatch", "munged")
CGROUPS = ("freezer", "cpuset", "memory", "devices")


def unavailable() -> str | None:
    missing = [p for p in PACKAGES if shutil.which(p) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install -y slurm-wlm munge"
    if not Path("/etc/munge/munge.key").exists():
        return "munge has no key (/etc/munge/munge.key): apt-get install -y munge makes one"
    return None


def _conf(cluster: Cluster, work: Path) -> str:
    cpus = os.cpu_count() or 1
    nodes = "".join(f"NodeName={n} NodeAddr={cluster.addr(n)} CPUs={cpus} State=UNKNOWN\n" for n in cluster.nodes)
    return f"""ClusterName=wb
SlurmctldHost=n1({cluster.addr('n1')})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={work}/state
SlurmdSpoolDir={work}/spool/%n
SlurmctldPidFile={work}/slurmctld.pid
SlurmdPidFile={work}/slurmd-%n.pid
SlurmctldLogFile={work}/slurmctld.log
SlurmdLogFile={work}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=600
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


class Slurm:
    """slurmctld + slurmd on `cluster`'s nodes, configured under `work`; `env` is what a Slurm
    client (sbatch, srun, submitit) needs to find it."""

    def __init__(self, cluster: Cluster, work: Path):
        self.cluster, self.work = cluster, Path(work)
        self.env = {**os.environ, "SLURM_CONF": str(self.work / "slurm.conf")}
        self.procs: list[subprocess.Popen] = []
        self.munged: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> Slurm:
        (self.work / "state").mkdir(parents=True, exist_ok=True)
        for n in self.cluster.nodes:
            (self.work / "spool" / n).mkdir(parents=True, exist_ok=True)
        (self.work / "slurm.conf").write_text(_conf(self.cluster, self.work))
        (self.work / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")
        self._munge()
        log = open(self.work / "daemons.out", "ab")
        self.procs.append(self.cluster.popen("n1", ["slurmctld", "-D", "-i"], env=self.env, stdout=log, stderr=log))
        for n in self.cluster.nodes:
            self.start_slurmd(n)
        self.wait_idle(timeout)
        return self

    def start_slurmd(self, node: str) -> None:
        """`node`'s slurmd, in its own mount namespace with the cgroup controllers it mounts; called
        again for a node whose slurmd was killed (it registers and the node returns to service,
        ReturnToService=2)."""
        mounts = " && ".join(["mount -t tmpfs none /sys/fs/cgroup",
                              *(f"mkdir -p /sys/fs/cgroup/{c} && mount -t cgroup -o {c} cgroup /sys/fs/cgroup/{c}"
                                for c in CGROUPS)])
        self.procs = [p for p in self.procs if p.poll() is None]  # a killed one is not a daemon that exited
        log = open(self.work / "daemons.out", "ab")
        self.procs.append(self.cluster.popen(node, ["sh", "-c", f"{mounts} && exec slurmd -D -N {node}"],
                                             mount_ns=True, env=self.env, stdout=log, stderr=log))

    def state(self, node: str) -> str:
        """sinfo's short state of `node` ("idle", "alloc", "down*", "idle*": * = not responding)."""
        done = self.client(["sinfo", "-h", "-n", node, "-o", "%t"], timeout=20)
        return done.stdout.strip()

    def _munge(self) -> None:
        """Use the machine's munged if one answers; else start one for as long as this Slurm runs."""
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        self.munged = subprocess.Popen(["munged", "--foreground", "--force"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(50):
            if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("munged did not answer within 5 s")

    def client(self, argv: list[str], node: str = "n1", timeout: float = 60) -> subprocess.CompletedProcess:
        """A Slurm client command run on `node` (n1 is also the login node)."""
        return self.cluster.run(node, argv, env=self.env, timeout=timeout)

    def wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited ({p.returncode}): {self.logs()}")
            done = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
            states = done.stdout.strip()
            if done.returncode == 0 and states and all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(1)
        raise RuntimeError(f"Slurm nodes not idle after {timeout:.0f} s: {states!r}; {self.logs()}")

    def logs(self, tail: int = 1500) -> str:
        out = []
        for p in sorted(self.work.glob("*.log")) + [self.work / "daemons.out"]:
            if p.exists():
                out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.munged is not None:
            self.munged.terminate()
            self.munged.wait(timeout=10)
