"""No silent hangs: a watchdog thread on every rank, and every rank stopping together.

Each rank's main thread marks its phase and step (workbench/core/heartbeat.py). A daemon thread
on every rank publishes that mark every few seconds, to the other ranks through the process
group's own key-value store (the c10d store torchrun set up: it answers while the main thread is
blocked in a collective), and watches two keys there:

- `error`: a rank whose run raised posts what it was doing and why (`fail`); the others stop
  within one beat instead of waiting for the collective timeout (`hardware.timeout_minutes`);
- `stall`: rank 0 judges progress. When no rank has changed phase or step for the phase's budget
  (`hardware.stall_timeout_s`, or, when 0, twenty times the run's median step time with a floor of
  five minutes; startup, evaluation, checkpoint and export get the long budget), or a rank's process is
  gone, it names the stalled ranks: a gone one, else the ones not waiting in a collective (read
  off each main thread's Python stack), else the ones furthest behind. Every rank then writes
  all its threads' stacks (faulthandler) to `<run_dir>/stalls/rank-<N>.txt`, rank 0 prints one
  `error:` line naming the ranks, phase, step, stack files and the last intact checkpoint, writes
  `<run_dir>/stalls/stall.json` (the launcher repeats its line instead of torchrun's table), and
  every rank exits with status 3.

On a GPU the NCCL watchdog does its own part (TORCH_NCCL_ASYNC_ERROR_HANDLING, the flight
recorder dump on timeout into the stalls folder: `gpu_env`).

    dog = Watchdog(run_dir, rank, world, stall_timeout_s=0, long_budget_s=1800)
    dog.start()                    # after the process group exists
    dog.step_time(seconds)         # the loop, after each step (the derived budget)
    dog.fail(exc)                  # the runner, when the run raises: the other ranks stop
    dog.blame(exc)                 # a collective failed here: the rank that is gone, if any

A rank whose run raises keeps its traceback in `<run_dir>/stalls/traceback-rank<N>.txt`
(`save_traceback`); the launcher's one line names that file, and the rank itself prints nothing
more (cli.py), so the user reads one line instead of a traceback per rank.

A rank that a signal ends (SIGKILL from the kernel's out-of-memory killer) raises nothing and
writes nothing: each heartbeat carries the rank's resident memory, so a peer that finds it gone
says how much it held at its last beat, and the launcher's line for it (`ended`, from what
torchrun's agent saw) names the signal, the memory known and this machine's.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from workbench.core import heartbeat
from workbench.core.errors import UserError
from workbench.core.secrets import redact, scrub_text
from workbench.train.distributed import launched_here

STALLED_EXIT = 3  # a rank stalled, or another rank failed: the run stopped (cli.py lists the statuses)
# A step phase is never called stalled sooner than FLOOR_S when the budget is derived from the step
# time: a single-process GRPO run starved of CPU by other jobs spent 10 median steps (118 s) in one
# rollout and was stopped though it was only slow. Five minutes still ends a hang long before the
# collective timeout (30 minutes).
FLOOR_S = 300.0
NODE_ADDR = "WORKBENCH_NODE_ADDR"  # this node's address, set by the launcher (workbench/launch/network.py)
PEER = re.compile(r"\[(\d{1,3}(?:\.\d{1,3}){3})\]:\d+")  # the peer in a transport error: "[10.0.0.2]:41235"
STEP_FACTOR = 20.0  # derived budget: this many median steps (GRPO's refill rounds make long steps)
FIRST_STEPS_S = 600.0  # until 3 steps have a time: compiling, first touches of memory
# a stack frame in these paths means the main thread waits for its peers (a collective)
WAITING = ("/torch/distributed/", "/deepspeed/comm/", "/megatron/core/parallel_state", "/torch/autograd/")
# the order of phases inside one step: of two ranks on the same step, the earlier phase is behind
ORDER = ("step", "data", "rollout", "reward function", "forward", "backward", "optimizer", "checkpoint", "evaluation",
         "export")


def traceback_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "stalls" / f"traceback-rank{rank}.txt"


def save_traceback(run_dir, rank: int, exc: BaseException, extra_secrets=()) -> Path:
    """Write `exc`'s traceback where the failure line points, scrubbed by the one rule
    (workbench/core/secrets.py; `extra_secrets`: the config's secret values); returns the path."""
    import traceback

    path = traceback_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(scrub_text("".join(traceback.format_exception(exc)), extra_secrets))
    return path


MISTAKE = "mistake.json"  # stalls/<this>: a rank's UserError, which a restart would meet again


def save_mistake(run_dir, rank: int, exc: BaseException, extra_secrets=()) -> None:
    """A rank stopped by a mistake in config, data or environment (a UserError that is not another
    rank's failure): the same on every attempt, so the launcher stops instead of restarting
    (workbench/launch/torchrun.py reads `stalls/mistake.json`)."""
    if not isinstance(exc, UserError) or isinstance(exc, RankFailure):
        return
    path = Path(run_dir) / "stalls" / MISTAKE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "message": scrub_text(" ".join(str(exc).split()), extra_secrets)}))


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(OOM kills the kernel counted in this process's memory cgroup, its limit in bytes), each
    None where unreadable. cgroup v2 memory.events / memory.max, else v1 memory.oom_control /
    memory.limit_in_bytes; the counter counts kills by any OOM killer, the machine's too."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")), None)
    places = []
    if v1 is not None:
        places += [(Path("/sys/fs/cgroup/memory") / v1.lstrip("/"), "memory.oom_control", "memory.limit_in_bytes"),
                   (Path("/sys/fs/cgroup/memory"), "memory.oom_control", "memory.limit_in_bytes")]
    if v2 is not None:
        places += [(Path("/sys/fs/cgroup") / v2.lstrip("/"), "memory.events", "memory.max"),
                   (Path("/sys/fs/cgroup"), "memory.events", "memory.max")]
    for folder, events, limit in places:
        try:
            counts = dict(ln.split()[:2] for ln in (folder / events).read_text().splitlines() if ln.strip())
        except (OSError, ValueError):
            continue
        try:
            cap = (folder / limit).read_text().strip()
            cap = int(cap) if cap.isdigit() and int(cap) < 2**60 else None  # "max" / 2**63: no limit
        except OSError:
            cap = None
        return (int(counts["oom_kill"]) if counts.get("oom_kill", "").isdigit() else None), cap
    return None, None


def _machine_bytes() -> int | None:
    try:
        kib = next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
        return int(kib) * 1024
    except (OSError, StopIteration, ValueError):
        return None


def ended(rank: int, pid: int, exitcode: int, stalls) -> str:
    """One line for a rank that ended without raising (torchrun's agent saw its process end; it
    left no traceback): a signal (SIGKILL: what the kernel's out-of-memory killer sends) or a bare
    exit status; its phase and memory at its last heartbeat when a peer recorded that beat
    (stall.json, matched by pid and host); and the largest peak of the launcher's finished
    processes (its workers among them: the kernel keeps a reaped child's peak, killed or not),
    against this machine's memory. Runs in the launcher."""
    import resource
    import signal

    beat = None
    try:
        beats = json.loads((Path(stalls) / "stall.json").read_text()).get("beats", {})
        mine = beats.get(str(rank)) or {}
        # the agent reports its own node's workers: a beat of that pid on this host is the process
        beat = mine if (mine.get("pid"), mine.get("host")) == (pid, socket.gethostname()) else None
    except (OSError, ValueError, AttributeError):
        pass
    if exitcode >= 0:
        head = f"rank {rank} exited with status {exitcode} without raising (no traceback)"
    else:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        head = f"rank {rank} was killed by {name} (exit {exitcode})"
    facts = []
    oom_kills, cap = _cgroup_memory()
    if exitcode == -signal.SIGKILL:
        counted = f"; OOM kills counted in this cgroup: {oom_kills}" if oom_kills is not None else ""
        facts.append(f"SIGKILL is what the kernel's out-of-memory killer sends when memory runs out{counted}")
    if beat:  # up to one watchdog interval old: where it was then, not where it died
        held = f" with {_gib(beat['rss'])} resident" if beat.get("rss") else ""
        facts.append(f"its last heartbeat ({max(0.0, time.time() - beat['beat']):.0f} s before) had it in "
                     f"{heartbeat.describe(beat['phase'], beat.get('detail', ''), beat['step'])}{held}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    sizes = [x for x in (cap, _machine_bytes()) if x]
    if peak:
        facts.append(f"the largest process this launcher ran (its workers) peaked at {_gib(peak)} resident"
                     + (f", of {_gib(min(sizes))} on this machine" if sizes else ""))
    hint = ("; lower the memory each process needs (a smaller model, micro-batch or data.seq_len, peft=lora, a "
            "sharding backend) or start fewer per node (hardware.procs)") if exitcode == -signal.SIGKILL else ""
    return head + (": " + "; ".join(facts) if facts else "") + hint


class RankFailure(UserError):
    """Another rank failed or stalled; this one stopped with it. `ranks`: the ranks found gone."""

    exit_code = STALLED_EXIT

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


def gpu_env(run_dir: Path) -> dict[str, str]:
    """NCCL's own watchdog settings on a GPU: errors raised instead of hanging, and the flight
    recorder's ring of recent collectives dumped into the stalls folder on a timeout."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(run_dir / "stalls" / "nccl_trace_rank_")}


def _process_runs(pid: int) -> bool:
    """Whether a process on this host still runs: it exists and is not a zombie (exited, not yet
    reaped by its parent, as a killed rank is until torchrun's agent looks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world: int, stall_timeout_s: float = 0.0,
                 long_budget_s: float = 1800.0, last_checkpoint=lambda: None, interval_s: float | None = None,
                 secrets=()):
        self.run_dir, self.rank, self.world = Path(run_dir), rank, world
        self.secrets = tuple(secrets)  # the config's secret values (core/secrets.py), kept out of every file here
        self.fixed = float(stall_timeout_s or 0.0)
        self.long_budget = float(long_budget_s)
        self.last_checkpoint = last_checkpoint  # -> path of the newest intact checkpoint, or None
        self.interval = interval_s or max(0.5, min(5.0, (self.fixed or FLOOR_S) / 10))
        self.steps: list[float] = []
        self.store = None
        self.host = socket.gethostname()
        self.started = time.time()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.local: dict[int, dict] = {}  # world == 1: the heartbeat without a store

    # -- the main thread's side ----------------------------------------------------------
    def start(self) -> None:
        import torch.distributed as dist

        if self.world > 1 and dist.is_initialized():
            # the process group's own store, under a prefix of ours; it answers from any thread
            base = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore("workbench/watchdog", base)
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="workbench-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def step_time(self, seconds: float) -> None:
        self.steps.append(seconds)

    def budget(self, phase: str) -> float:
        if self.fixed:
            step = self.fixed
        elif len(self.steps) >= 3:
            step = max(FLOOR_S, STEP_FACTOR * statistics.median(self.steps[-50:]))
        else:
            step = FIRST_STEPS_S
        return max(step, self.long_budget) if phase in heartbeat.LONG_PHASES else step

    def fail(self, exc: BaseException) -> None:
        """This rank's run raised: tell the others (first failure wins), so they stop now."""
        if self.store is None:
            return
        if not isinstance(exc, RankFailure):
            save_traceback(self.run_dir, self.rank, exc, self.secrets)
        error = scrub_text(f"{type(exc).__name__}: {exc}", self.secrets)[:500]  # scrubbed before it is cut
        # own: this rank's failure, not its stopping because another rank failed or went
        record = {"rank": self.rank, "where": heartbeat.where(), "error": error,
                  "own": not isinstance(exc, RankFailure)}
        if isinstance(exc, RankFailure) and exc.ranks:  # the ranks this one found gone, and its verdict
            record.update(ranks=list(exc.ranks), verdict=scrub_text(str(exc), self.secrets)[:2000])
        record = json.dumps(redact(record, self.secrets))
        try:
            first = self.store.compare_set("error", "", record).decode() == record
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing to tell
            return
        if first and not isinstance(exc, RankFailure):  # the launcher repeats this line (launch/torchrun.py)
            folder = self.run_dir / "stalls"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "failure.json").write_text(json.dumps(redact(
                {"rank": self.rank, "message": f"rank {self.rank} failed in {heartbeat.where()}: {error} "
                                               f"(traceback: {traceback_path(self.run_dir, self.rank)})"},
                self.secrets)))

    def blame(self, exc: BaseException) -> BaseException:
        """A collective raised here (a peer's connection closed, a timeout): when a peer is gone,
        the run failed because of it; say so instead of the transport's message."""
        if self.world == 1 or self.store is None:
            return exc
        deadline = time.time() + 3 * self.interval  # a peer that just died may not look gone yet
        while True:
            told = self._told()
            if told is not None:
                return told
            beats = self._beats()
            gone = [r for r, hb in beats.items() if r != self.rank and not self._alive(hb)]
            if gone or time.time() > deadline:
                break
            time.sleep(0.2)
        told = self._told()  # the peer may have written why as it left, after the last look
        if told is not None:
            return told
        reason = "process gone"
        if not gone:  # a peer on another node: the transport names its address (gloo: "[10.0.0.2]:port")
            peer = PEER.search(str(exc))
            gone = [r for r, hb in beats.items() if r != self.rank and peer and hb.get("addr") == peer.group(1)]
            reason = "its node closed the connection"
        if not gone:
            return exc
        self._write_stacks(note=f"a collective failed here: {type(exc).__name__}: {str(exc)[:300]}")
        for r in gone:
            self._write_gone(r, beats.get(r))
        where = "; ".join(f"{self._who(r, beats.get(r))} in {self._where(beats.get(r))}{self._held(beats.get(r))}"
                          for r in gone)
        msg = (f"rank(s) {', '.join(map(str, gone))} stopped answering ({reason}): {where}; stacks in "
               f"{self.run_dir / 'stalls'}; last intact checkpoint: {self.last_checkpoint() or 'none'}")
        self._record({"ranks": gone, "reason": reason, "message": msg, "beats": {str(k): v for k, v in beats.items()}})
        return RankFailure(msg, ranks=gone)

    def _told(self) -> RankFailure | None:
        """A peer that failed by itself said why in the store before it left (fail): that, when
        this rank's collective broke on its absence, rather than "stopped answering". A loaded
        machine can let the collective break before the watchdog's next tick reads it."""
        error = self._get("error")
        if not error:
            return None
        e = json.loads(error)
        if e["rank"] == self.rank:
            return None
        if not e.get("own"):
            # A survivor that found ranks gone is not why; its verdict is, unless it names this rank
            # (the same loss, said the same way on every node, whichever peer's socket broke here).
            gone = e.get("ranks") or []
            return RankFailure(e["verdict"], ranks=gone) if gone and self.rank not in gone else None
        return RankFailure(f"rank {self.rank} stops: rank {e['rank']} failed in {e['where']}: {e['error']}",
                           ranks=[e["rank"]])

    # -- the thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - the watchdog must never take the run down itself
                print(scrub_text(f"watchdog (rank {self.rank}): {type(exc).__name__}: {exc}"), file=sys.stderr)

    def _tick(self) -> None:
        self._publish()
        error = self._get("error")
        if error:
            e = json.loads(error)
            if e["rank"] != self.rank:
                if not launched_here():  # else the launcher's one line says it (launch/torchrun.py)
                    print(f"rank {self.rank} stops: rank {e['rank']} failed in {e['where']}: {e['error']}",
                          file=sys.stderr)
                self._exit()
            return
        stall = self._get("stall")
        if stall:
            self._on_stall(json.loads(stall))
            return
        if self.rank == 0:
            verdict = self._judge()
            if verdict is not None:
                self._set("stall", json.dumps(verdict))
                self._on_stall(verdict)

    def _publish(self) -> None:
        b = heartbeat.BEAT
        record = {"phase": b.phase, "detail": b.detail, "step": b.step, "since": b.since, "beat": time.time(),
                  "pid": os.getpid(), "host": self.host, "addr": os.environ.get(NODE_ADDR, ""),
                  "waiting": self._waiting(), "rss": resident_bytes()}
        if self.store is None:
            self.local[self.rank] = record
        else:
            self.store.set(f"hb/{self.rank}", json.dumps(record))

    def _waiting(self) -> bool:
        """Whether the main thread is inside a collective (waiting for its peers)."""
        frame = sys._current_frames().get(self._main)
        depth = 0
        while frame is not None and depth < 12:
            if any(p in frame.f_code.co_filename.replace("\\", "/") for p in WAITING):
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def _beats(self) -> dict[int, dict]:
        if self.store is None:
            return dict(self.local)
        out = {}
        for r in range(self.world):
            raw = self._get(f"hb/{r}")
            if raw:
                out[r] = json.loads(raw)
        return out

    def _alive(self, hb: dict | None) -> bool:
        if hb is None:  # not published yet: still starting (its start is what is judged)
            return time.time() - self.started < max(FIRST_STEPS_S, self.long_budget)
        if hb["host"] == self.host and not _process_runs(hb["pid"]):
            return False
        return time.time() - hb["beat"] < max(30.0, 6 * self.interval)

    def _judge(self) -> dict | None:
        beats = self._beats()
        now = time.time()
        gone = [r for r in range(self.world) if r != self.rank and not self._alive(beats.get(r))]
        if gone:
            remote = any((beats.get(r) or {}).get("host", self.host) != self.host for r in gone)
            reason = "no heartbeat from its node: unreachable or gone" if remote else "process gone"
            return {"ranks": gone, "reason": reason, "beats": {str(k): v for k, v in beats.items()}}
        live = [hb for hb in beats.values()]
        if not live:
            return None
        long_phase = any(hb["phase"] in heartbeat.LONG_PHASES for hb in live)
        budget = self.budget(heartbeat.LONG_PHASES[0] if long_phase else "step")
        idle = now - max(hb["since"] for hb in live)
        if idle < budget:
            return None
        busy = [r for r, hb in beats.items() if not hb["waiting"]]
        if not busy:  # all wait: the ones behind (earlier step, then earlier phase)
            key = {r: (hb["step"], ORDER.index(hb["phase"]) if hb["phase"] in ORDER else -1) for r, hb in beats.items()}
            least = min(key.values())
            busy = [r for r, k in key.items() if k == least]
        return {"ranks": sorted(busy), "reason": f"no progress for {idle:.0f} s (budget {budget:.0f} s)",
                "beats": {str(k): v for k, v in beats.items()}}

    def _on_stall(self, verdict: dict) -> None:
        beats = {int(k): v for k, v in verdict.get("beats", {}).items()}
        self._write_stacks(note=f"stall declared: {verdict['reason']}")
        self._set(f"dumped/{self.rank}", "1")
        if self.rank != 0:
            time.sleep(2 * self.interval)  # rank 0 says it, then everyone goes
            self._exit()
        deadline = time.time() + max(5.0, 3 * self.interval)
        while time.time() < deadline and not all(self._get(f"dumped/{r}") for r in range(self.world)
                                                 if self._alive(beats.get(r))):
            time.sleep(0.2)
        for r in range(self.world):
            if not self._alive(beats.get(r)):
                self._write_gone(r, beats.get(r))
        named = verdict["ranks"]
        what = "; ".join(f"{self._who(r, beats.get(r))} in {self._where(beats.get(r))}"
                         + ("" if self._alive(beats.get(r)) else self._held(beats.get(r))) for r in named)
        files = ", ".join(str(self.run_dir / "stalls" / f"rank-{r}.txt") for r in range(self.world))
        msg = (f"rank(s) {', '.join(map(str, named))} stalled ({verdict['reason']}): {what}; stacks: {files}; "
               f"last intact checkpoint: {self.last_checkpoint() or 'none'}")
        self._record({**verdict, "message": msg})
        print(f"error: {scrub_text(msg)}", file=sys.stderr, flush=True)
        self._exit()

    def _who(self, rank: int, hb: dict | None) -> str:
        """"rank 1 on n2 (10.0.0.2)": the node a rank ran on, as its heartbeat said, when that is
        another node than this rank's."""
        if not hb or hb.get("host") == self.host:
            return f"rank {rank}"
        addr = f" ({hb['addr']})" if hb.get("addr") else ""
        return f"rank {rank} on {hb['host']}{addr}"

    def _where(self, hb: dict | None) -> str:
        if hb is None:
            return "startup (never reported)"
        return heartbeat.describe(hb["phase"], hb.get("detail", ""), hb["step"])

    @staticmethod
    def _held(hb: dict | None) -> str:
        """", 1.4 GiB resident at its last heartbeat" for a rank that is gone (the kernel's
        out-of-memory killer leaves no other trace of what it held)."""
        return f", {_gib(hb['rss'])} resident at its last heartbeat" if hb and hb.get("rss") else ""

    def _write_stacks(self, note: str) -> None:
        folder = self.run_dir / "stalls"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"rank-{self.rank}.txt", "w") as fh:
            fh.write(scrub_text(f"rank {self.rank} (pid {os.getpid()}, {self.host}) in {heartbeat.where()}\n{note}\n\n"))
            fh.flush()
            faulthandler.dump_traceback(file=fh, all_threads=True)

    def _write_gone(self, rank: int, hb: dict | None) -> None:
        folder = self.run_dir / "stalls"
        folder.mkdir(parents=True, exist_ok=True)
        pid = f"pid {hb['pid']}, {hb['host']}" if hb else "never reported"
        (folder / f"rank-{rank}.txt").write_text(scrub_text(f"rank {rank} ({pid}) in {self._where(hb)}{self._held(hb)}: "
                                                            "the process is gone, so it left no stack\n"))

    def _record(self, verdict: dict) -> None:
        if self.rank == 0 or self.world == 1 or self.store is None:
            folder = self.run_dir / "stalls"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "stall.json").write_text(json.dumps(redact(verdict), indent=1, default=str))

    def _exit(self) -> None:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(STALLED_EXIT)

    def _get(self, key: str) -> str | None:
        if self.store is None:
            return self.local.get(key)  # type: ignore[return-value]
        try:
            if not self.store.check([key]):
                return None
            value = self.store.get(key)
        except Exception:  # noqa: BLE001 - a store that went away reads as "nothing new"
            return None
        return value.decode() if value else None

    def _set(self, key: str, value: str) -> None:
        if self.store is None:
            self.local[key] = value  # type: ignore[assignment]
        else:
            self.store.set(key, value)
