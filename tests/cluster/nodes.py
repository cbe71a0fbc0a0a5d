"""Nodes on one machine: each a Linux network namespace with its own interface, address, hostname
and TCP stack, joined by veth pairs to a bridge that lives in a namespace of its own.

    python scripts/local_cluster.py up --nodes 2        # the same, by hand (as root)
    with Cluster(2) as c:                               # in a test
        c.run("n1", ["hostname"])                       # -> "n1"
        c.kill("n2")                                    # every process of node 2
        c.cut("n2")                                     # node 2's link down (processes keep running)

Addresses come from 198.18.0.0/15 (reserved for network testing) and exist only inside the
namespaces made here: the root namespace gets no address and no route to them, so nothing leaves
the machine. Names resolve through `/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts
over /etc/hosts inside the namespace, so the machine's own /etc/hosts is never touched; each
node's own name resolves to 127.0.1.1 there, as on a default Debian install (`hosts`). Each
command runs in a new UTS namespace whose hostname is the node's (`unshare --uts`).

`down()` kills every process in the namespaces, deletes them and their hosts files, and
`leftovers()` lists whatever of a cluster is still there, so a test can prove it left nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
STATE_DIR = Path("/run/workbench-cluster")


def unavailable() -> str | None:
    """Why nodes cannot be made here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "local cluster nodes need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"local cluster nodes need `{tool}` (Debian: apt-get install iproute2 util-linux)"
    probe = f"wbprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@dataclass
class Cluster:
    """`n` nodes named n1..nN at 198.18.<subnet>.11.. ; `tag` keeps concurrent clusters apart."""

    n: int = 2
    tag: str = field(default_factory=lambda: f"wb{os.getpid() % 100000}")
    subnet: int = field(default_factory=lambda: 1 + os.getpid() % 250)
    up_: bool = False

    @property
    def nodes(self) -> list[str]:
        return [f"n{i}" for i in range(1, self.n + 1)]

    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def addr(self, node: str) -> str:
        return f"198.18.{self.subnet}.{10 + int(node[1:])}"

    def ifname(self, node: str) -> str:  # the node's interface (inside its namespace)
        return "eth0"

    def up(self) -> Cluster:
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, node in enumerate(self.nodes, 1):
                ns = self.ns(node)
                _ip("netns", "add", ns)
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
                _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"p{i}", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(self.hosts(node))
                (NETNS_ETC / ns / "hostname").write_text(node + "\n")
        except BaseException:
            self.down()
            raise
        self.up_ = True
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps({"n": self.n, "tag": self.tag, "subnet": self.subnet}))
        return self

    def hosts(self, node: str) -> str:
        """/etc/hosts as a default Debian node has it: its own name on 127.0.1.1, so anything
        that finds its address by resolving its own hostname gets loopback (gloo, torchrun's
        rendezvous), and the other nodes by name, as a cluster's DNS gives them."""
        others = "".join(f"{self.addr(x)} {x}\n" for x in self.nodes if x != node)
        return f"127.0.0.1 localhost\n127.0.1.1 {node}\n{others}"

    def command(self, node: str, argv: list[str], mount_ns: bool = False) -> list[str]:
        """argv wrapped to run on `node`: its network namespace, its hostname (and with
        `mount_ns` a private mount namespace, for daemons that mount things)."""
        unshare = ["unshare", "--uts", *(["--mount"] if mount_ns else [])]
        return ["ip", "netns", "exec", self.ns(node), *unshare, "sh", "-c", f'hostname {node} && exec "$@"', "sh", *argv]

    def popen(self, node: str, argv: list[str], mount_ns: bool = False, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, argv, mount_ns), start_new_session=True, **kw)

    def run(self, node: str, argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(node, argv), timeout=timeout, **kw)

    def pids(self, node: str) -> list[int]:
        done = _ip("netns", "pids", self.ns(node), check=False)
        return [int(p) for p in done.stdout.split()]

    def kill(self, node: str, sig: int = signal.SIGKILL) -> list[int]:
        """Every process of `node` (what losing the machine does to them); returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def cut(self, node: str) -> None:
        """Take `node`'s link down at the switch: its processes live on, unreachable."""
        _ip("-n", self.switch, "link", "set", f"p{self.nodes.index(node) + 1}", "down")

    def down(self) -> None:
        for node in self.nodes:
            for _ in range(50):
                if not self.kill(node):
                    break
                time.sleep(0.1)
            _ip("netns", "del", self.ns(node), check=False)
            shutil.rmtree(NETNS_ETC / self.ns(node), ignore_errors=True)
        _ip("netns", "del", self.switch, check=False)
        (STATE_DIR / f"{self.tag}.json").unlink(missing_ok=True)
        self.up_ = False

    def leftovers(self) -> list[str]:
        """What of this cluster still exists: namespaces, hosts files, processes."""
        listed = _ip("netns", "list", check=False).stdout.split()
        left = [f"namespace {x}" for x in listed if x.startswith(f"{self.tag}-")]
        left += [f"file {p}" for p in NETNS_ETC.glob(f"{self.tag}-*")]
        return left

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def saved(tag: str | None = None) -> list[Cluster]:
    """Clusters that `scripts/local_cluster.py up` left running (all, or the one named `tag`)."""
    out = []
    for path in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []:
        s = json.loads(path.read_text())
        if tag in (None, s["tag"]):
            out.append(Cluster(n=s["n"], tag=s["tag"], subnet=s["subnet"], up_=True))
    return out
