"""Publishing a directory whole: a reader finds the complete old directory or the complete new
one, never a part, whenever the writer stops (an exception, kill -9, a power cut). Checkpoints
(workbench/checkpoints/checkpoint.py), the best checkpoint (workbench/checkpoints/keep_best.py) and cache
entries (workbench/core/cache.py) are all written this way.

    from workbench.core import atomic
    with atomic.publishing(final) as tmp:     # fill tmp; on success it becomes `final`,
        write_files(tmp)                      # on an exception it is removed and `final` is untouched
    atomic.current(final)                     # the complete directory to read, or None

    tmp = atomic.staging(final)               # when writing and publishing happen apart (a
    ...                                       # checkpoint: every rank writes, rank 0 publishes)
    atomic.publish(tmp, final)
    atomic.write_text(path, text)             # one small file (a pointer, a table), replaced whole

How: the files are written into the sibling `<name>.tmp`; every file and directory in it is
fsynced, then it is renamed to `<name>` and the parent directory is fsynced, so after a crash
the directory is there with all its bytes or not at all. A directory cannot be renamed onto a
non-empty one, so replacing takes two renames: the old directory moves aside to `<name>.old`,
then the new one moves in. Between the two, `current(final)` finds the old one; the next
publish first moves an orphaned `.old` back. So at every instant a reader that goes through
`current()` finds one complete directory. Anything that must agree with the files (keep_best's
best.json) is written inside the directory, so it moves with them. One writer per destination
(rank 0, or the holder of the cache's lock); `.tmp` and `.old` names are never published.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TMP, OLD = ".tmp", ".old"


def aside(path: Path) -> bool:
    """Whether `path` is a directory in the making or one set aside (listings skip these)."""
    return Path(path).name.endswith((TMP, OLD))


def staging_path(final: Path) -> Path:
    """Where the new content of `final` is written: its sibling `<name>.tmp`."""
    final = Path(final)
    return final.with_name(final.name + TMP)


def staging(final: Path) -> Path:
    """`staging_path(final)`, emptied of a crashed writer's leftovers and created."""
    tmp = staging_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def current(final: Path) -> Path | None:
    """The complete directory a reader should open: `final`, or, when a publish stopped between
    its two renames, the old one it set aside; None when neither exists."""
    final = Path(final)
    if final.is_dir():
        return final
    old = final.with_name(final.name + OLD)
    return old if old.is_dir() else None


def publish(tmp: Path, final: Path) -> Path:
    """Make the filled `tmp` the directory `final`, durably, replacing a previous `final`."""
    tmp, final = Path(tmp), Path(final)
    old = final.with_name(final.name + OLD)
    if not final.exists() and old.is_dir():
        os.rename(old, final)  # an earlier publish stopped between its renames: the old one is current
    _sync_tree(tmp)
    if old.exists():
        shutil.rmtree(old)  # left by a publish that stopped before its clean-up; `final` is whole
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    _sync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def publishing(final: Path) -> Iterator[Path]:
    """A staging directory to fill; published as `final` when the block ends without an exception."""
    tmp = staging(final)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, final)


def write_text(path: Path, text: str) -> None:
    """Replace the file `path` with `text` whole (a unique temp file, fsynced, renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def _sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every directory, deepest first (their entries)."""
    dirs = [folder]
    for p in sorted(folder.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in reversed(dirs):
        _sync_dir(d)


def _sync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles: the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; nothing more can be done there
    finally:
        os.close(fd)
