"""What tensors occupy on CPU at their peak over a few training steps: the CPU counterpart of
torch.cuda.max_memory_allocated, read by the plan check (workbench/run/finish.py) and by
tests/integration/test_plan_memory.py.

    window = Window(); window.start()                 # counts every tensor alive now
    ... train a step or two ...
    peak_bytes = window.stop()                        # alive at the start + the largest growth

The start counts the distinct storages of every tensor Python can reach (gc), the growth is the
torch CPU allocator's running total from the profiler's memory events (profile_memory=True),
with the total kept for allocations on every thread. The process's resident set would add the
Python heap, libraries and what glibc keeps after a free: a cold cache's model conversion or
GRPO's rollouts leave hundreds of MB resident that no tensor holds, and the planner models
tensors, not the allocator.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import tempfile

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor: this rank's shard; NF4
    weights: with their quantisation constants); meta tensors (weights a backend released) hold none."""
    seen: dict[int, int] = {}
    todo = list(tensors)
    for t in todo:
        qs = getattr(t, "quant_state", None)
        if qs is not None:
            todo += [qs.absmax] + ([qs.state2.absmax] if getattr(qs, "state2", None) is not None else [])
    for t in todo:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_meta or t.device.type != "cpu":
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
            continue
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def alive_bytes() -> int:
    """Bytes of every CPU tensor Python holds now. type(), not isinstance: isinstance reads
    `__class__`, which some lazily imported modules answer with a deprecation warning.

    `python -m workbench` freezes what was built before training (workbench/core/startup.py),
    the model's weights among it, and gc.get_objects() does not list frozen objects: they are
    thawed for the scan and frozen again after it, with what the collection left alive."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        gc.collect()
        return storage_bytes(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    finally:
        if frozen:
            gc.freeze()


def _c10_flag(name: str, ctype):
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    return ctype.in_dll(lib, name)


@contextlib.contextmanager
def _set(flag, value):
    before = flag.value
    flag.value = value
    try:
        yield
    finally:
        flag.value = before


def count_every_thread():
    """Make the CPU allocator keep its running total for allocations and frees on every thread.

    Without this flag the total changes only on threads the profiler runs on, so a tensor made
    here and released on a collective's worker thread (gloo drops its references there, at a time
    that varies from run to run) would stay in the total for good.
    """
    return _set(_c10_flag("FLAGS_caffe2_report_cpu_memory_usage", ctypes.c_bool), True)


def _quiet_c10():
    """c10 warns once when a tensor made before the window is freed inside it ("Memory block of
    unknown size"); that free is simply not subtracted, which can only raise the peak. ERROR
    level (2) for the window keeps the run's log clean."""
    return _set(_c10_flag("FLAGS_caffe2_log_level", ctypes.c_int), 2)


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto prints a line to fd 2 when a profiler starts and stops; a run's log is no place
    for it. Held for the start or stop call only."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class Window:
    """Tensor memory over the steps between start() and stop(), in bytes at its peak."""

    def __init__(self):
        self.prof, self.alive, self._flags = None, 0, contextlib.ExitStack()

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.alive = alive_bytes()
        self._flags.enter_context(count_every_thread())
        self._flags.enter_context(_quiet_c10())
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self.prof.__enter__()

    def stop(self) -> int:
        """alive at the start + the running total's largest growth over the window."""
        with _quiet_stderr():
            self.prof.__exit__(None, None, None)
        self._flags.close()
        grown = max(0, max(growth(self.prof), default=0))
        self.prof = None
        return self.alive + grown


def growth(prof) -> list[int]:
    """The allocator's running total ("Total Allocated", kept on every thread), in time order,
    relative to where the profiler began. Only the Chrome trace carries the total; the kineto
    events give each allocation's own bytes, which miss a free made on another thread."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    events = sorted((e for e in trace if e.get("name") == "[memory]" and "Total Allocated" in e.get("args", {})),
                    key=lambda e: e["ts"])  # the trace is not in time order
    if not events:
        return []
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return [e["args"]["Total Allocated"] - start for e in events]
