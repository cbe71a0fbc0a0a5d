"""Nodes on this machine, to try multi-node runs without a cluster (root; Linux network namespaces).

    python scripts/local_cluster.py up --nodes 2            # n1, n2 at 198.18.<k>.11, .12
    python scripts/local_cluster.py up --nodes 2 --slurm    # ... with slurmctld on n1 and a slurmd per node
    python scripts/local_cluster.py exec n1 -- hostname     # a command on a node (its hostname, address, TCP stack)
    python scripts/local_cluster.py exec n1 -- srun -N2 hostname
    python scripts/local_cluster.py status
    python scripts/local_cluster.py down                    # every node, daemon and hosts file gone

A 2-node run of the workbench, one command per node (docs/guides/multi-node.md):

    python scripts/local_cluster.py exec n1 -- .venv/bin/python -m workbench model=tiny backend=fsdp2 \\
        hardware.nodes=2 hardware.node_rank=0 hardware.rdzv_endpoint=<n1's address>:29400 output_dir=/tmp/mn &
    python scripts/local_cluster.py exec n2 -- ... hardware.node_rank=1 ...

The nodes are tests/cluster/nodes.py's and Slurm is tests/cluster/slurm.py's (the same harness
the `cluster` test tier uses). Slurm needs `apt-get install -y slurm-wlm munge`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster import nodes, slurm  # noqa: E402


def up(n: int, with_slurm: bool) -> int:
    why = nodes.unavailable() or (slurm.unavailable() if with_slurm else None)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    if nodes.saved():
        print("error: a local cluster is up already (python scripts/local_cluster.py down)", file=sys.stderr)
        return 2
    c = nodes.Cluster(n).up()
    for node in c.nodes:
        print(f"{node}: {c.addr(node)} (namespace {c.ns(node)}, interface eth0)")
    if with_slurm:
        work = nodes.STATE_DIR / f"{c.tag}-slurm"
        s = slurm.Slurm(c, work).start()
        state = nodes.STATE_DIR / f"{c.tag}.json"
        state.write_text(json.dumps({**json.loads(state.read_text()), "slurm_conf": s.env["SLURM_CONF"],
                                     "munged": s.munged.pid if s.munged else None}))
        print(f"slurm: slurmctld on n1, slurmd on {', '.join(c.nodes)}; SLURM_CONF={s.env['SLURM_CONF']} "
              "(set for you by `exec`)")
    return 0


def down() -> int:
    for c in nodes.saved():
        state = json.loads((nodes.STATE_DIR / f"{c.tag}.json").read_text())
        c.down()  # every process in the namespaces: slurmctld, slurmd and what they ran
        if state.get("munged"):
            try:
                os.kill(state["munged"], 15)
            except ProcessLookupError:
                pass
        shutil.rmtree(nodes.STATE_DIR / f"{c.tag}-slurm", ignore_errors=True)
        left = c.leftovers()
        print(f"{c.tag}: down" + (f"; left behind: {left}" if left else ""))
    return 0


def run_on(node: str, argv: list[str]) -> int:
    clusters = nodes.saved()
    if not clusters:
        print("error: no local cluster is up (python scripts/local_cluster.py up)", file=sys.stderr)
        return 2
    c = clusters[0]
    state = json.loads((nodes.STATE_DIR / f"{c.tag}.json").read_text())
    env = {**os.environ, **({"SLURM_CONF": state["slurm_conf"]} if state.get("slurm_conf") else {})}
    return subprocess.run(c.command(node, argv), env=env).returncode


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="local_cluster", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--slurm", action="store_true")
    sub.add_parser("down")
    sub.add_parser("status")
    p = sub.add_parser("exec")
    p.add_argument("node")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.cmd == "up":
        return up(a.nodes, a.slurm)
    if a.cmd == "down":
        return down()
    if a.cmd == "status":
        for c in nodes.saved():
            print(f"{c.tag}: " + ", ".join(f"{x} {c.addr(x)}" for x in c.nodes))
        return 0
    return run_on(a.node, a.argv[1:] if a.argv[:1] == ["--"] else a.argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
