"""The workbench cache: every entry is written by one process and is either complete or absent.

    $WORKBENCH_CACHE (default ~/.cache/workbench)/
        models/<name>/          a packaged GGUF dequantised into an HF directory
        tokenised/<fp>/         a tokenised data source (workbench/data/cache.py)
        ref_logps/<fp>/         DPO reference log-probs
        peak_flops.json         measured matmul FLOP/s per device, dtype and thread count

Entries are built by `build(path, make)`: a file lock (`<path>.lock`) makes one process the
writer while every other process waits for it (ranks of one job, two jobs on one machine);
`make` fills a temporary directory beside the entry; a seal listing every file and its size
is written last, and the directory is published (workbench/core/atomic.py: fsynced, renamed
into place). A reader trusts an entry only when
its seal matches what is on disk; a broken or unsealed entry (a crash mid-write, a folder
from an older version, a copy a distributed save left half-written) is removed and rebuilt,
with one line on stderr saying which and why.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from workbench.core import atomic

SEAL = ".complete.json"


def root() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


@contextmanager
def lock(path: Path):
    """Hold `<path>.lock` across processes (filelock: flock on POSIX, released if we die)."""
    from filelock import FileLock

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def seal(directory: Path) -> None:
    """Record every file under `directory` with its size; written last."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != SEAL}
    atomic.write_text(directory / SEAL, json.dumps({"files": files}, indent=1))


def problem(directory: Path, required: tuple[str, ...] = ()) -> str | None:
    """Why the entry at `directory` cannot be trusted, or None when it is complete."""
    directory = Path(directory)
    if not directory.exists():
        return "absent"
    try:
        files = json.loads((directory / SEAL).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no seal (written by an interrupted or older process)"
    for name in required:
        if name not in files:
            return f"{name} missing"
    for name, size in files.items():
        p = directory / name
        if not p.is_file():
            return f"{name} missing"
        if p.stat().st_size != size:
            return f"{name} has {p.stat().st_size} bytes, the seal says {size}"
    return None


def build(path: Path, make: Callable[[Path], None], what: str, required: tuple[str, ...] = ()) -> Path:
    """The complete entry at `path`, made by `make(tmp_dir)` in exactly one process if needed."""
    path = Path(path)
    if problem(path, required) is None:
        return path
    with lock(path):
        why = problem(path, required)
        if why is None:  # another process built it while this one waited for the lock
            return path
        if why != "absent":
            print(f"cache: {what} at {path} is broken ({why}); rebuilding it", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
        with atomic.publishing(path) as tmp:  # the lock makes this process its one writer
            make(tmp)
            seal(tmp)
    if (why := problem(path, required)) is not None:
        raise RuntimeError(f"cache: {what} at {path} is still incomplete after building it ({why})")
    return path


def update_json(path: Path, key: str, compute: Callable[[], float], valid: Callable[[float], bool]) -> float:
    """`key` from a shared JSON table, computing and storing it when absent or invalid.
    Read-modify-write happens under the lock, so concurrent writers never drop each other's keys."""
    path = Path(path)

    def read() -> dict:
        try:
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    known = read().get(key)
    if isinstance(known, (int, float)) and valid(float(known)):
        return float(known)
    try:
        with lock(path):
            table = read()
            known = table.get(key)
            if isinstance(known, (int, float)) and valid(float(known)):
                return float(known)
            table[key] = float(compute())
            atomic.write_text(path, json.dumps(table, indent=1))
            return table[key]
    except OSError:  # a read-only cache: measure, do not keep
        return float(compute())
