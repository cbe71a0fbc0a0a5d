"""`launcher=local`: which runs start under torchrun. More than one process does, and so does
backend=deepspeed on one (DeepSpeed's engine refuses to start without the LOCAL_RANK a launcher
sets); everything else runs in this process. The dry run says so.

    python -m pytest -q tests/unit/test_launch_local.py
"""

from __future__ import annotations

import pytest

from tests.conftest import compose
from workbench.launch import dispatch as launch
from workbench.launch import torchrun


@pytest.fixture
def started(monkeypatch):
    """The configs torchrun.launch was asked to start (none is started)."""
    calls = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(torchrun, "launch", lambda cfg: calls.append(cfg) or {"launched": "torchrun"})
    return calls


@pytest.mark.parametrize("overrides, under_torchrun", [
    (["backend=deepspeed"], True),
    (["backend=deepspeed", "hardware.procs=2"], True),
    (["backend=fsdp2", "hardware.procs=2"], True),
    (["backend=fsdp2"], False),
    (["backend=single"], False),
])
def test_which_runs_start_under_torchrun(tmp_path, started, overrides, under_torchrun):
    result = launch.dispatch(compose(overrides, tmp_path))
    assert bool(started) == under_torchrun and (result is not None) == under_torchrun


def test_a_launched_worker_runs_here(tmp_path, started, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's worker: never launched twice
    assert launch.dispatch(compose(["backend=deepspeed"], tmp_path)) is None and not started


def test_dry_run_names_the_launch(tmp_path, capsys, monkeypatch):
    from workbench import cli

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    cli.run_job(compose(["backend=deepspeed", "dry_run=true"], tmp_path, validate=False))
    out = capsys.readouterr().out
    assert "preflight ok" in out and "launch: torchrun (backend=deepspeed runs only in a launched process" in out


def test_a_peers_verdict_in_a_traceback_is_the_restart_line(tmp_path):
    """A rank that found a peer gone raises RankFailure; when its traceback lands before rank 0's
    stall.json, the launcher's line is the verdict itself, not "rank 1 failed: ...RankFailure"."""
    from workbench.guard.watchdog import RankFailure

    stalls = tmp_path / "stalls"
    stalls.mkdir()
    verdict = "rank(s) 2 stopped answering (its node closed the connection): rank 2 on n3"
    (stalls / "traceback-rank1.txt").write_text(
        f"Traceback (most recent call last):\n  ...\n{RankFailure.__module__}.RankFailure: {verdict}\n")
    assert str(torchrun._failure(stalls)) == verdict
    (stalls / "traceback-rank1.txt").write_text("Traceback (most recent call last):\nValueError: bad shape\n")
    line = str(torchrun._failure(stalls))
    assert line.startswith("rank 1 failed: ValueError: bad shape (traceback: ")
