"""Start the same run under torchrun's elastic agent when more than one process is asked for.

    python -m workbench backend=fsdp2 hardware.procs=2                       # one node, 2 processes
    python -m workbench hardware.procs=8 hardware.max_restarts=3             # restart on failure
    python -m workbench hardware.nodes=2 hardware.procs=8 hardware.rdzv_endpoint=head:29400   # on each node

`dispatch()` calls `launch(cfg)` only when this process is not already a torchrun/accelerate
worker, so a user's own `torchrun -m workbench ...` is never launched twice. The workers run
`python -m workbench` with this command line's Hydra overrides and `output_dir` pinned, so all
ranks, all restarts and all nodes write to one run directory. An elastic restart re-runs every
worker; with `train.resume=auto` they continue from the newest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

from workbench.config.files import CONF_DIR
from workbench.core.errors import UserError
from workbench.guard.watchdog import MISTAKE, RankFailure, ended
from workbench.launch import network
from workbench.resolve.resolved import resolve_run
from workbench.train.distributed import LAUNCHED_BY, requested_procs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_args(cfg) -> list[str]:
    """`-m workbench` plus this job's overrides, with output_dir pinned to the resolved path;
    a primary config other than conf/train.yaml (`--config-path/--config-name`, as the far side
    of a remote launch and `python -m workbench.export` use) is passed on too."""
    primary: list[str] = []
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        overrides = list(hc.overrides.task)
        main = [s for s in hc.runtime.config_sources if s.provider == "main"]
        if main and main[0].schema == "file":
            path = Path(main[0].path).resolve()

            if path != CONF_DIR.resolve() or hc.job.config_name != "train":
                primary = ["--config-path", str(path), "--config-name", hc.job.config_name]
    except ValueError:  # not under @hydra.main (e.g. called from Python): nothing to forward
        overrides = []
    keep = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "output_dir"]
    return ["-m", "workbench", *primary, *keep, f"output_dir={Path(cfg.output_dir).resolve()}"]


def launch_config(cfg, route=None):
    """torchrun's settings for this node; `route` (workbench/launch/network.py) is the address
    the other nodes reach this one at, advertised instead of the hostname."""
    from torch.distributed.launcher.api import LaunchConfig

    hw = cfg.hardware
    rdzv_configs: dict = {"join_timeout": int(hw.rdzv_timeout_s)}
    if hw.node_rank >= 0:
        rdzv_configs["is_host"] = hw.node_rank == 0
    elif route is not None:  # torch decides by resolving the hostname, which may give loopback
        rdzv_configs["is_host"] = route.here
    return LaunchConfig(
        min_nodes=hw.min_nodes or hw.nodes, max_nodes=hw.nodes, nproc_per_node=hw.procs, run_id=hw.rdzv_id,
        rdzv_backend="c10d", rdzv_endpoint=hw.rdzv_endpoint or f"127.0.0.1:{_free_port()}",
        rdzv_configs=rdzv_configs, max_restarts=hw.max_restarts, monitor_interval=1.0,
        start_method="spawn", local_addr=route.address if route else None,
    )


def launch(cfg) -> dict | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.launcher.api import elastic_launch

    resolve_run(cfg)  # the rule table (e.g. deepspeed missing) speaks before any worker starts
    # Presets of the hardware profile (NCCL transport settings and the like) reach every worker;
    # values the user exported already win.
    for key, value in (cfg.hardware.env or {}).items():
        os.environ.setdefault(str(key), str(value))
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.hardware.threads or 1))
    os.environ[LAUNCHED_BY] = "torchrun"
    hw = cfg.hardware
    if hw.min_nodes and int(hw.min_nodes) < int(hw.nodes):
        # A node joining a running elastic job (growing back): torch's shared rendezvous store
        # gives the workers' address to each agent once, at its first rendezvous, so a newcomer
        # waits for an address nobody publishes in the new round and the round times out
        # (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py `next_rendezvous`). Without
        # the sharing, rank 0 publishes it every round.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    route = network.prepare(hw.rdzv_endpoint, hw.node_addr) if hw.rdzv_endpoint else None
    config = launch_config(cfg, route)
    args = worker_args(cfg)
    nodes = f"{config.min_nodes}-{config.max_nodes}" if config.min_nodes != config.max_nodes else str(hw.nodes)
    print(f"launching {nodes} x {hw.procs} workers (torchrun, rendezvous {config.rdzv_endpoint}, "
          f"this node {network.describe(route)}, max_restarts={config.max_restarts})", file=sys.stderr)
    stalls = Path(cfg.output_dir) / "stalls"
    if int(hw.nodes) == 1:  # an earlier launch's verdicts are not this one's (nodes share the folder: kept there)
        _clear(stalls)
    try:
        with _quiet_agent(stalls, hw) as restarts:
            elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as exc:
        raise _failure(stalls, exc, restarts.seen) or RuntimeError(f"distributed run failed: {exc.format_msg()}") from None
    except RendezvousTimeoutError:
        raise RankFailure(_waited(cfg, config, route)) from None
    return _results(cfg)


def _waited(cfg, config, route) -> str:
    """One line for a rendezvous that did not fill within hardware.rdzv_timeout_s: who waited,
    where, and which node(s) it waited for."""
    hw = cfg.hardware
    me = f"node_rank {hw.node_rank} " if hw.node_rank >= 0 else ""
    if hw.node_rank >= 0 and hw.nodes == 2:
        missing = f"node_rank {1 - hw.node_rank} never joined"
    else:
        missing = f"fewer than {config.min_nodes} of {hw.nodes} nodes joined"
    return (f"rendezvous at {config.rdzv_endpoint} incomplete after {hw.rdzv_timeout_s:.0f} s "
            f"(hardware.rdzv_timeout_s): {missing}; {me}({network.describe(route)}) waited. Start the same "
            "command on every node with its hardware.node_rank, and check that each reaches the endpoint")


@contextlib.contextmanager
def _quiet_agent(stalls: Path, hw):
    """torchrun's agent logs each failed worker's exit code and a root-cause table; the one line
    made by `_failure` says which rank failed, where and why, so the agent's error log is held
    back while it runs (its warnings and info still show). When the agent restarts the workers
    (hardware.max_restarts, a lost node under hardware.min_nodes), that line is said then."""
    log = logging.getLogger("torch.distributed.elastic")
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    restarts = _Restarts(stalls, hw)
    levels = log.level, agent.level
    log.setLevel(logging.CRITICAL)
    agent.setLevel(logging.INFO)  # its restart record reaches the filter, which shows none of its records
    agent.addFilter(restarts)
    try:
        yield restarts
    finally:
        agent.removeFilter(restarts)
        log.setLevel(levels[0])
        agent.setLevel(levels[1])


class _Restarts(logging.Filter):
    """Turns the agent's "will restart worker group" record into one line naming what happened.
    The run directory (and its stalls/ folder) is shared by every node, so a verdict is never
    deleted once said: each node says it in its own line, and remembers it (`seen`) so that its
    next restart's line is about the next failure."""

    def __init__(self, stalls: Path, hw):
        super().__init__()
        self.stalls, self.hw, self.count = stalls, hw, 0
        self.seen = _verdicts(stalls)  # an earlier launch's verdicts are not this one's

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "will restart worker group" in message:  # logged at INFO: shown as this line only
            if "new nodes" in message:  # a node (back, or a replacement) waits to join: no failure
                print(f"node(s) joining: the workers checkpoint at the end of this step and continue on "
                      f"up to {self.hw.nodes} nodes from there (membership changes use no restart)",
                      file=sys.stderr, flush=True)
                return record.levelno >= logging.WARNING
            mistake = _mistake(self.stalls, self.seen)
            if mistake is not None and "attempts left" in message:
                # A mistake in config, data or environment is met again by every restart: stop now,
                # keeping the restarts for lost nodes. Raised from the agent's own log call, before
                # it restarts the group; its run loop then shuts the workers down and re-raises.
                raise mistake
            self.count += 1
            failure = _awaited(self.stalls, self.seen)
            nodes = f"at least {self.hw.min_nodes} of {self.hw.nodes} nodes" if self.hw.min_nodes else "every node"
            print(f"restart {self.count} of {self.hw.max_restarts}: {failure or 'a worker exited'}; continuing from "
                  f"the last checkpoint with {nodes} (hardware.min_nodes)", file=sys.stderr, flush=True)
            self.seen = _verdicts(self.stalls)  # the next restart's line is about the next failure
        return record.levelno >= logging.WARNING


def _awaited(stalls: Path, seen: set, wait_s: float = 15.0):
    """The failure not yet said, waiting up to `wait_s` for it: this node's workers may have stopped
    because another node's did (the rendezvous closed), before the rank that saw the loss wrote it."""
    deadline = time.monotonic() + wait_s
    while True:
        failure = _failure(stalls, seen=seen)
        if failure is not None or time.monotonic() > deadline:
            return failure
        time.sleep(0.5)


def _verdicts(stalls: Path) -> set:
    """What the stalls folder holds now (file name and text), so that a line says only what is new."""
    out = set()
    for path in [*(stalls / n for n in ("stall.json", "failure.json", MISTAKE)), *stalls.glob("traceback-rank*.txt")]:
        try:
            out.add((path.name, path.read_text()))
        except OSError:
            continue
    return out


def _mistake(stalls: Path, seen=frozenset()) -> UserError | None:
    """A rank's mistake (workbench/guard/watchdog.py `save_mistake`) as the one error line."""
    try:
        text = (stalls / MISTAKE).read_text()
        found = json.loads(text)
    except (OSError, ValueError):
        return None
    if (MISTAKE, text) in seen:
        return None
    return UserError(f"rank {found.get('rank', '?')} stopped: {found.get('message', '?')} (the same on every "
                     "restart, so the job stops without using the rest of hardware.max_restarts)")


def _clear(stalls: Path) -> None:
    for name in ("stall.json", "failure.json", MISTAKE):
        (stalls / name).unlink(missing_ok=True)
    for old in stalls.glob("traceback-rank*.txt"):
        old.unlink()


def _failure(stalls: Path, exc=None, seen=frozenset()):
    """What the workers' watchdog found (workbench/guard/watchdog.py), as one line; else the last
    line of the first rank's traceback that a worker left (cli.py), naming its file. A rank's own
    failure comes first: the peers that then find it gone record that as a stall too. A rank a
    signal ended (SIGKILL: the kernel's out-of-memory killer) raised nothing and wrote nothing:
    torchrun's agent saw it (`exc`, its ChildFailedError), and it comes before its peers' stall,
    which it caused; a rank that exited without raising, last."""
    found = {}
    for name in ("failure.json", "stall.json"):
        try:
            text = (stalls / name).read_text()
            if (name, text) not in seen:  # `seen`: said already (_Restarts)
                found[name] = json.loads(text)["message"]
        except (OSError, ValueError, KeyError):
            continue
    if "failure.json" in found:
        return RankFailure(found["failure.json"])
    gone = sorted((getattr(exc, "failures", None) or {}).items())  # global rank -> ProcessFailure
    for rank, f in gone:
        # SIGTERM is how the agent stops the other workers once one has failed: not a cause
        if f.exitcode < 0 and f.signal_name() != "SIGTERM":
            return RankFailure(ended(rank, f.pid, f.exitcode, stalls))
    if "stall.json" in found:
        return RankFailure(found["stall.json"])
    verdict = f"{RankFailure.__module__}.{RankFailure.__name__}: "  # how a traceback ends on one
    for path in sorted(stalls.glob("traceback-rank*.txt")):
        text = path.read_text()
        if (path.name, text) in seen:
            continue
        lines = [x for x in text.splitlines() if x.strip()]
        last = lines[-1] if lines else "?"
        if last.startswith(verdict):  # this rank found a peer gone (watchdog.blame) before rank 0 wrote
            return RankFailure(last.removeprefix(verdict))  # stall.json: the verdict is the line
        rank = path.stem.removeprefix("traceback-rank")
        return RankFailure(f"rank {rank} failed: {last} (traceback: {path})")
    if gone:
        return RankFailure(ended(gone[0][0], gone[0][1].pid, gone[0][1].exitcode, stalls))
    return None


def _results(cfg) -> dict:
    """What the workers left in the run directory (rank 0 writes the report)."""
    run_dir = Path(cfg.output_dir)
    out: dict = {"launched": "torchrun", "output_dir": str(run_dir.resolve()),
                 "world_size": requested_procs(cfg.hardware)}
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        by_step: dict = {}  # after an elastic restart the resumed steps are logged again: last wins
        for line in metrics.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if "loss" in row and "step" in row:
                by_step[row["step"]] = row["loss"]
        out["losses"] = [by_step[k] for k in sorted(by_step)]
    return out
