"""Publishing directories whole (workbench/core/atomic.py): the best checkpoint, a cache entry and
a checkpoint are found complete, old or new, whichever step of the publish a crash interrupts.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_atomic.py
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from workbench.checkpoints import keep_best
from workbench.core import atomic, cache

METRIC = "loss/loss"


class Crash(BaseException):
    """The process dying at this point (BaseException: no `except Exception` swallows it)."""


def _checkpoint(run_dir, step: int) -> None:
    """A committed step directory whose files name their step."""
    d = run_dir / "checkpoints" / f"step-{step:08d}"
    (d / "sub").mkdir(parents=True)
    (d / "model.safetensors").write_text(f"weights of step {step}")
    (d / "sub" / "optim.pt").write_text(f"optimizer of step {step}")


def _seen(run_dir) -> int | None:
    """The step of the best checkpoint a reader finds now; its files must be that step's."""
    found, rec = keep_best.best_dir(run_dir), keep_best.record(run_dir)
    if found is None:
        assert rec is None
        return None
    assert rec is not None, "best/ without its best.json"
    assert (found / "model.safetensors").read_text() == f"weights of step {rec['step']}"
    assert (found / "sub" / "optim.pt").read_text() == f"optimizer of step {rec['step']}"
    return rec["step"]


class Fail:
    """Counts the file-system steps of a publish (renames, fsyncs, removals), checks what a reader
    finds before each one, and dies at the k-th (a removal dies half-way, one file gone)."""

    def __init__(self, monkeypatch, run_dir, at: int | None, allowed: set):
        self.run_dir, self.at, self.allowed, self.calls = run_dir, at, allowed, 0
        for mod, name in ((os, "rename"), (os, "replace"), (os, "fsync"), (shutil, "rmtree")):
            monkeypatch.setattr(mod, name, self._wrap(getattr(mod, name), name))

    def _wrap(self, real, name):
        def step(*args, **kwargs):
            self.calls += 1
            assert _seen(self.run_dir) in self.allowed  # at every instant: a whole old or a whole new best
            if self.calls == self.at:
                if name == "rmtree" and os.path.isdir(args[0]):
                    files = sorted(p.path for p in os.scandir(args[0]) if p.is_file())
                    if files:
                        os.unlink(files[0])
                raise Crash(f"{name} #{self.calls}")
            return real(*args, **kwargs)
        return step


def _run_with_best_of_step_1(tmp_path):
    run_dir = tmp_path / "run"
    for step in (1, 2, 3):
        _checkpoint(run_dir, step)
    assert keep_best.Keeper(run_dir, METRIC).update({"eval/loss/loss": 2.0}, 1)
    assert _seen(run_dir) == 1
    return run_dir


def test_the_crash_points_are_counted(tmp_path, monkeypatch):
    run_dir = _run_with_best_of_step_1(tmp_path)
    fail = Fail(monkeypatch, run_dir, None, {1, 2})
    assert keep_best.Keeper(run_dir, METRIC).update({"eval/loss/loss": 1.0}, 2)
    assert 8 <= fail.calls <= 12 and _seen(run_dir) == 2  # the test below crashes at each of these


@pytest.mark.parametrize("at", range(1, 13))
def test_keep_best_survives_a_crash_at_every_step_of_the_publish(tmp_path, monkeypatch, at):
    run_dir = _run_with_best_of_step_1(tmp_path)
    with monkeypatch.context() as m:
        fail = Fail(m, run_dir, at, {1, 2})
        try:
            keep_best.Keeper(run_dir, METRIC).update({"eval/loss/loss": 1.0}, 2)
            crashed = False
        except Crash:
            crashed = True
    if not crashed:
        assert fail.calls < at and _seen(run_dir) == 2
        return
    seen = _seen(run_dir)  # after the crash: the old best or the new one, each with its own record
    assert seen in (1, 2)
    resumed = keep_best.Keeper(run_dir, METRIC)  # a resumed run compares against what is on disk
    assert resumed.best["step"] == seen
    # the next improvement publishes cleanly over whatever the crash left
    assert resumed.update({"eval/loss/loss": 0.5}, 3) and _seen(run_dir) == 3
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if "best" in p.name) == ["best"]


def test_a_failed_copy_leaves_the_old_best(tmp_path, monkeypatch):
    run_dir = _run_with_best_of_step_1(tmp_path)

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(keep_best.shutil, "copytree", full_disk)
    with pytest.raises(OSError):
        keep_best.Keeper(run_dir, METRIC).update({"eval/loss/loss": 1.0}, 2)
    assert _seen(run_dir) == 1 and not (run_dir / "checkpoints" / "best.tmp").exists()


def test_publish_replaces_a_directory_and_current_finds_the_old_one_between_the_renames(tmp_path):
    final = tmp_path / "entry"
    with atomic.publishing(final) as tmp:
        (tmp / "a").write_text("old")
    with atomic.publishing(final) as tmp:
        (tmp / "a").write_text("new")
    assert (atomic.current(final) / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]
    # stopped between the two renames: `entry` moved aside, the new one not yet in place
    os.rename(final, tmp_path / "entry.old")
    assert (atomic.current(final) / "a").read_text() == "new"
    with atomic.publishing(final) as tmp:  # the next publish puts it back first, then replaces it
        (tmp / "a").write_text("newer")
    assert (atomic.current(final) / "a").read_text() == "newer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_a_cache_entry_whose_build_fails_is_absent_and_rebuilt(tmp_path):
    entry = tmp_path / "tokenised" / "abc"

    def broken(tmp):
        (tmp / "ids.npy").write_text("half")
        raise RuntimeError("tokeniser died")

    with pytest.raises(RuntimeError):
        cache.build(entry, broken, "tokenised source", ("ids.npy",))
    assert cache.problem(entry, ("ids.npy",)) == "absent"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["abc.lock"]
    cache.build(entry, lambda tmp: (tmp / "ids.npy").write_text("whole"), "tokenised source", ("ids.npy",))
    assert cache.problem(entry, ("ids.npy",)) is None and (entry / "ids.npy").read_text() == "whole"
    assert json.loads((entry / cache.SEAL).read_text())["files"] == {"ids.npy": 5}
