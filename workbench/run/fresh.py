"""`train.resume=never` into a directory that holds a run: the old run is moved aside, whole and by
name, before anything of the new one is written, so the new run starts fresh instead of
appending to it (its metrics.jsonl, checkpoints, results and report).

    moved = set_aside(run_dir)    # rank 0, before the tracker opens: <run_dir>.old-<time>, or None

Moving, not refusing: `train.resume=never` is how the refusals of workbench/checkpoints/resume.py and
resume_changes.py tell a user to start again in the same directory, and deleting a run someone
may still want is not this command's call. The old run goes beside the directory
(`runs/x.old-2026-12-03_10-14-44`), not inside it, so `python -m workbench.report runs/x` and a
later `train.resume=auto` see one run only. What Hydra writes for this launch before the job
starts (`.hydra/`, `cli.log`) stays, and so does the folder a launcher of this workbench watches
for its workers (`stalls/`, when this process is one of them).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

# Written for this launch before the runner starts (Hydra), never a run's record.
THIS_LAUNCH = (".hydra", "cli.log")


def _old_run(run_dir: Path, keep: tuple[str, ...]) -> list[Path]:
    """What in `run_dir` belongs to an earlier run: everything but this launch's own files (an
    empty tensorboard folder, which the tracker recreates, is no run)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name not in keep)


def set_aside(run_dir, launched: bool = False, now: float | None = None) -> Path | None:
    """Move an earlier run out of `run_dir` into `<run_dir>.old-<time>` (a free name), saying so in
    one line; None when there was nothing to move. `launched`: this process is a worker of this
    workbench's launcher, which owns `stalls/`."""
    run_dir = Path(run_dir)
    keep = THIS_LAUNCH + (("stalls",) if launched else ())
    old = _old_run(run_dir, keep)
    if not old:
        return None
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now or time.time()))
    dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    dest.mkdir(parents=True)
    for p in old:
        shutil.move(str(p), str(dest / p.name))
    return dest


def line(run_dir, dest: Path) -> str:
    """The console line for a run moved aside."""
    return (f"train.resume=never: {run_dir} held an earlier run; moved it to {dest} (nothing deleted) and starting a "
            "new run there")
