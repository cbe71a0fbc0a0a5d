"""backend=deepspeed on the default single process: `python -m workbench` starts it under torchrun
on one process and it trains, instead of DeepSpeed's AssertionError about LOCAL_RANK.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_deepspeed_one_process.py
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import TINY
from tests.helpers import finish, logged_losses, workbench

pytestmark = pytest.mark.distributed


def test_deepspeed_on_one_process_trains(tmp_path):
    log = finish(workbench([*TINY, "backend=deepspeed", "train.max_steps=2", f"output_dir={tmp_path}"]))
    assert "launching 1 x 1 workers (torchrun" in log and "LOCAL_RANK" not in log
    assert len(logged_losses(tmp_path)) == 2
    assert json.loads((tmp_path / "manifest.json").read_text())["world_size"] == 1
