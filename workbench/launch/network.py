"""Which address and interface this node uses to reach the other nodes, decided once before any
worker starts.

    python -m workbench hardware.nodes=2 hardware.rdzv_endpoint=198.18.0.11:29400 ...   # on each node

By default torchrun's rendezvous advertises this machine's hostname, and gloo (and NCCL's socket
bootstrap) resolve the hostname to find their interface. On a node whose hostname other nodes
cannot resolve, or that resolves to 127.0.0.1 (Debian's default /etc/hosts), the rendezvous
waits forever or gloo connects over loopback. So, before launching, the node asks the kernel
which local address routes to the rendezvous host (a UDP `connect`, which sends nothing), names
the interface that holds it, advertises that address (torchrun's `local_addr`) and points
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME at that interface. Values the user exported win;
`hardware.node_addr` overrides the address.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from workbench.core.errors import UserError
from workbench.guard.watchdog import NODE_ADDR

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class Route:
    host: str  # the rendezvous host as given
    port: int
    address: str  # this node's address on the way there
    ifname: str  # the interface holding that address ("" if none found)
    here: bool = False  # the endpoint is this node: it hosts the rendezvous store

    @property
    def loopback(self) -> bool:
        return _loopback(self.address)


def split_endpoint(endpoint: str, field: str = "hardware.rdzv_endpoint") -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"{field}={endpoint!r}: expected host:port, e.g. 10.0.0.1:29400")
    return host.strip("[]"), int(port)


def route_to(host: str, port: int, field: str = "hardware.rdzv_endpoint") -> Route:
    """This node's address and interface towards host:port; a UserError naming `field` when the
    host does not resolve or no route leads there."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise UserError(f"{field}: {host!r} does not resolve on {socket.gethostname()} ({exc.strerror}); "
                        "give the first node's address or a name every node resolves") from None
    remote = infos[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(remote)  # UDP: picks the route and source address, sends nothing
        except OSError as exc:
            raise UserError(f"{field}: no route from {socket.gethostname()} to {host} ({remote[0]}): "
                            f"{exc.strerror}") from None
        address = s.getsockname()[0]
    return Route(host, port, address, interface_of(address), here=address == remote[0])


def interface_of(address: str) -> str:
    """The name of the interface that holds `address` ("" when none does)."""
    import psutil  # a dependency of accelerate: its net_if_addrs is the portable interface table

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return ""


def _loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or "localhost"."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def outward(field: str) -> tuple[str, str]:
    """(address, interface) other machines reach this one at: the default route's interface, else
    the only interface that is up with an IPv4 address other than loopback."""
    import psutil

    addrs = {name: [a.address for a in v if a.family == socket.AF_INET and not _loopback(a.address)]
             for name, v in psutil.net_if_addrs().items()}
    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    try:  # /proc/net/route: the row whose destination is 0.0.0.0 names the default route's interface
        rows = [line.split() for line in open("/proc/net/route").read().splitlines()[1:]]
        default = [r[0] for r in rows if len(r) > 1 and r[1] == "00000000"]
    except OSError:
        default = []
    for name in default:
        if addrs.get(name):
            return addrs[name][0], name
    candidates = [name for name in sorted(addrs) if addrs[name] and name in up]
    if len(candidates) == 1:
        return addrs[candidates[0]][0], candidates[0]
    raise UserError(f"{field}: this node ({socket.gethostname()}) resolves its own name to loopback and has "
                    f"{len(candidates)} candidate interfaces ({', '.join(candidates) or 'none'}); set "
                    "hardware.node_addr to the address the other nodes reach it at")


def prepare(endpoint: str, node_addr: str = "", field: str = "hardware.rdzv_endpoint") -> Route | None:
    """Pin the interface gloo/NCCL use for this node and return the route (None when every rank
    is on this machine, where loopback is right). Sets IFNAME variables only where unset."""
    host, port = split_endpoint(endpoint, field)
    route = route_to(host, port, field)
    if node_addr:
        route = Route(host, port, node_addr, interface_of(node_addr), here=route.here)
    if route.loopback:
        if _loopback(host):  # 127.0.0.1 / localhost: every rank is on this machine
            return None
        # the endpoint is this node, by a name that resolves to loopback here (Debian puts the
        # hostname on 127.0.1.1): the others reach it at its outward interface's address
        route = Route(host, port, *outward(field), here=True)
    os.environ[NODE_ADDR] = route.address  # the watchdog names a lost node by it (workbench/guard/watchdog.py)
    if route.ifname:
        for var in IFNAME_VARS:
            os.environ.setdefault(var, route.ifname)
    return route


def describe(route: Route | None) -> str:
    if route is None:
        return "this machine"
    return f"{socket.gethostname()} {route.address} ({route.ifname or 'interface unknown'})"
