"""The service's futures: every long call is queued, run by one worker thread, and polled.

The Tinker SDK submits a request (`forward_backward`, `optim_step`, `asample`, ...), gets back
`{"request_id": ...}` at once, then polls `/api/v1/retrieve_future` until the result is there.
Here each submitted job goes onto one FIFO queue served by a single worker thread: the model's
state (weights, gradients, optimizer) is touched by that thread only, and jobs run in the order
the client submitted them, which is the order the SDK's per-client turn counter guarantees.

    store = FutureStore()
    rid = store.submit("ForwardBackward", job)       # job() -> Result, run on the worker thread
    entry = await store.wait(rid, timeout_s=10)      # the long poll: returns early when done
    store.fail_pending("the service is stopping")   # every unfinished future fails with this

A job raises `ServeError` (a request the service cannot honour: category "user") or anything
else (a bug or a crash: category "server", the exception's class and message only, never a
traceback with local values in it).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.core.secrets import scrub_text


class ServeError(Exception):
    """A request the service cannot honour: shown to the client as one line (category "user")."""


@dataclass
class Result:
    """A finished job's payload: JSON-able `body`, or `proto` bytes (forward_backward, sample)."""

    body: dict | None = None
    proto: bytes | None = None


@dataclass
class Entry:
    request_id: str
    kind: str
    created: float = field(default_factory=time.time)
    result: Result | None = None
    error: str | None = None
    category: str = "server"
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, result: Result | None = None, error: str | None = None, category: str = "server") -> bool:
        """Record the outcome once; False when it was already recorded (a stop raced the job)."""
        if self.done.is_set():
            return False
        self.result, self.error, self.category = result, error, category
        self.done.set()
        return True


# Finished futures are kept this long for the client to collect (it normally does within
# milliseconds); a bound, so a client that never polls cannot grow the service's memory.
KEEP_FINISHED_S = 3600.0


class FutureStore:
    def __init__(self, on_error: Callable[[str, str], None] | None = None):
        self._entries: dict[str, Entry] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._ids = itertools.count(1)
        self._stopping: str | None = None
        self._on_error = on_error  # (kind, message): the service log line for a failed job
        self._worker = threading.Thread(target=self._run, name="workbench-serve-worker", daemon=True)
        self._worker.start()

    # -- submitting --------------------------------------------------------------------------
    def submit(self, kind: str, job: Callable[[], Result]) -> str:
        rid = f"req-{next(self._ids)}"
        entry = Entry(rid, kind)
        with self._lock:
            self._entries[rid] = entry
            self._forget_old()
        if self._stopping is not None:
            entry.finish(error=self._stopping, category="server")
        else:
            self._queue.put((entry, job))
        return rid

    def done_now(self, kind: str, result: Result) -> str:
        """A future that is finished as it is made (create_model's answer, get-style calls)."""
        rid = f"req-{next(self._ids)}"
        entry = Entry(rid, kind)
        entry.finish(result=result)
        with self._lock:
            self._entries[rid] = entry
        return rid

    def _forget_old(self) -> None:
        cutoff = time.time() - KEEP_FINISHED_S
        for rid in [r for r, e in self._entries.items() if e.done.is_set() and e.created < cutoff]:
            del self._entries[rid]

    # -- the worker ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            entry, job = self._queue.get()
            if entry.done.is_set():  # failed by a stop before it ran
                continue
            try:
                entry.finish(result=job())
            except ServeError as exc:
                entry.finish(error=str(exc), category="user")
            except Exception as exc:  # a bug or a crash: the class and the message, no locals
                msg = scrub_text(f"{type(exc).__name__}: {exc}")
                if entry.finish(error=f"the service failed running {entry.kind}: {msg}", category="server"):
                    if self._on_error is not None:
                        self._on_error(entry.kind, "".join(traceback.format_exception(exc)))

    # -- polling -------------------------------------------------------------------------------
    def get(self, rid: str) -> Entry | None:
        with self._lock:
            return self._entries.get(rid)

    async def wait(self, rid: str, timeout_s: float) -> Entry | None:
        """The entry, once finished or after `timeout_s` (a long poll: the client asks again)."""
        entry = self.get(rid)
        if entry is None:
            return None
        deadline = time.monotonic() + timeout_s
        # Polling an Event from the event loop in short sleeps: no thread parked per waiting
        # client, and a stop (fail_pending) is seen within one tick.
        while not entry.done.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return entry

    def fail_pending(self, message: str) -> int:
        """Fail every unfinished future with `message` (the service is stopping); later submits
        fail the same way. Returns how many were failed."""
        self._stopping = message
        with self._lock:
            pending = [e for e in self._entries.values() if not e.done.is_set()]
        return sum(e.finish(error=message, category="server") for e in pending)

    def pending(self) -> int:
        with self._lock:
            return sum(not e.done.is_set() for e in self._entries.values())
