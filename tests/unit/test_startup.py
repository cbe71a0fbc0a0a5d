"""The garbage-collector pause of a command-line launch (workbench/core/startup.py), in-process.

    .venv/bin/python -m pytest -q tests/unit/test_startup.py
"""

from __future__ import annotations

import gc

import pytest

from workbench.core import startup


@pytest.fixture(autouse=True)
def _restore_collector():
    yield
    startup.after_job()
    gc.unfreeze()
    gc.enable()


def test_pause_training_after_job_cycle():
    startup.pause()
    assert not gc.isenabled()
    garbage = [object() for _ in range(10)]
    startup.training()  # what start-up made moves to the permanent generation; the collector runs again
    assert gc.isenabled() and gc.get_freeze_count() > len(garbage)
    startup.after_job()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_without_pause_the_runner_calls_change_nothing():
    """Tests and notebooks call the runner without `python -m workbench`: nothing is frozen."""
    startup.training()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    startup.after_job()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_job_that_never_trains_turns_the_collector_back_on():
    """A dry run, a remote launch or an error returns before the first step."""
    startup.pause()
    startup.after_job()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_pause_leaves_a_collector_the_caller_disabled_alone():
    gc.disable()
    startup.pause()
    startup.training()
    startup.after_job()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
