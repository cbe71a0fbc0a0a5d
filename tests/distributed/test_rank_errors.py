"""An exception inside one rank reaches the user as one line: the rank, its phase and step, the
exception, and the file its traceback went to; no rank prints Hydra's "Error executing job" block
or a traceback, and torchrun's agent prints no failure table.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_rank_errors.py
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import TINY
from tests.helpers import one_error_line

pytestmark = pytest.mark.distributed


def raising(completions, **_) -> list[float]:
    """A reward function that raises on rank 1."""
    if os.environ.get("RANK") == "1":
        raise ValueError("reward service answered 503")
    return [float(len(c)) for c in completions]


def test_an_exception_in_rank_1_is_one_line_naming_its_traceback(tmp_path):
    args = [*TINY, "backend=fsdp2", "peft=none", "hardware.procs=2", "train.max_steps=2", "++hardware.timeout_minutes=4",
            "method=grpo", "method.num_generations=2", "train.micro_batch_size=2", "train.grad_accum=1",
            "method.max_new_tokens=4", f"reward.functions=[{__name__}:raising]", f"output_dir={tmp_path}"]
    line, log = one_error_line(args)
    trace = tmp_path / "stalls" / "traceback-rank1.txt"
    assert line.startswith("error: rank 1 failed in reward function") and "at step 1" in line, line
    assert "ValueError: reward service answered 503" in line and f"(traceback: {trace})" in line, line
    assert "Error executing job" not in log and "Traceback (most recent call last)" not in log, log[-4000:]
    assert "exitcode" not in log and "Root Cause" not in log, log[-4000:]  # torchrun's agent table
    assert "Traceback" in trace.read_text() and "test_rank_errors:raising" in trace.read_text()
