"""What the console shows: the workbench's lines and Hydra's, and no line that is not the user's to
act on (docs/guides/watching.md, "Console lines").

    .venv/bin/python -m pytest -q tests/unit/test_console.py

A multirun through the real CLI, on a machine whose matplotlib has no font cache yet, of a LoRA
job then a QLoRA job in one process: bitsandbytes stays out of the LoRA job
(workbench/core/imports.py skip_bitsandbytes) and comes back for the QLoRA one; third-party INFO
records (matplotlib's font cache) stay off the console (conf/hydra/*_logging/redacted.yaml).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# A logging record as Hydra's job logging formats it, and a Python warning as Python prints it.
LOG_LINE = re.compile(r"^\[[^\]]+\]\[(?P<name>[^\]]+)\]\[(?P<level>[A-Z]+)\] - ")
PY_WARNING = re.compile(r"\b\w*Warning: ")


def _run(args: list[str], tmp_path) -> str:
    cache = tmp_path / "mplconfig"
    cache.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WORKBENCH_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1", "MPLCONFIGDIR": str(cache)}
    proc = subprocess.run([sys.executable, "-m", "workbench", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def not_the_users(out: str) -> list[str]:
    """Lines of `out` that a library logged or warned on its own account: records of loggers other
    than the workbench's and Hydra's, and Python warnings."""
    bad = []
    for line in out.splitlines():
        m = LOG_LINE.match(line)
        if (m and not m["name"].startswith(("workbench", "hydra"))) or PY_WARNING.search(line):
            bad.append(line)
    return bad


def test_multirun_console_has_hydra_and_workbench_lines_only(tmp_path):
    sweep = tmp_path / "sweep"
    out = _run(["-m", "model=tiny", "debug=fast", "peft=lora,qlora", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert "Launching 2 jobs locally" in out and "#0 : " in out and "#1 : " in out, out
    assert out.count("done: 2 steps") == 2, out
    assert not not_the_users(out), not_the_users(out)
    assert "font_manager" not in out and "bitsandbytes" not in out, out
    assert any((tmp_path / "mplconfig").iterdir())  # the font cache was built in this run, off the console
    # the QLoRA job quantised (bitsandbytes came back after the LoRA job hid it): other numbers
    losses = [json.loads((sweep / str(n) / "results.json").read_text())["losses"] for n in (0, 1)]
    assert losses[0] != losses[1], losses


def test_bitsandbytes_is_hidden_from_a_job_without_qlora_and_back_for_one():
    """skip_bitsandbytes per job of one process: peft imported under a LoRA job leaves
    bitsandbytes out; a later QLoRA job imports it, and peft's cached probe answers again."""
    pytest.importorskip("bitsandbytes")
    script = """
import sys
from workbench.core.imports import skip_bitsandbytes
skip_bitsandbytes(False)
import peft
from peft.import_utils import is_bnb_4bit_available
assert sys.modules["bitsandbytes"] is None and not is_bnb_4bit_available()
skip_bitsandbytes(True)
import bitsandbytes
assert is_bnb_4bit_available() and sys.modules["bitsandbytes"] is bitsandbytes
skip_bitsandbytes(False)
assert sys.modules["bitsandbytes"] is bitsandbytes  # once imported, it stays
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bitsandbytes_optional_kernel_notice_is_dropped_and_its_other_records_pass():
    import workbench.peft.lora  # noqa: F401  (installs the filter before peft can import bitsandbytes)

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")

    def record(msg):
        return logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, ("No module named 'kernels'",), None)

    assert not log.filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure "
                                 "you already `pip install kernels` and the kernels >= 0.11.1"))
    assert log.filter(record("another warning: %s"))


def test_malformed_json_names_what_and_where_once(tmp_path):
    from workbench.core.errors import UserError
    from workbench.data.readers import read_jsonl

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1", "completion": "2"}\n{"prompt": "2+2, "completion": "4"}\n{"prompt": "x')
    with pytest.raises(UserError) as err:
        list(read_jsonl(path))
    assert "rows.jsonl:2: malformed JSON (Expecting ',' delimiter at column 19)" in str(err.value)
    bad: list[str] = []
    list(read_jsonl(path, on_bad=lambda e: bad.append(str(e))))
    assert "rows.jsonl:3: the last line is truncated" in bad[1] and "Unterminated string starting at column 12" in bad[1], bad
    assert not any(" at at " in b for b in bad), bad
