"""`--help` pages: `python -m workbench --help` lists the config groups with their choices (from
conf/), ten example commands that compose, and where the docs are; `python -m workbench.export
--help` prints its usage with status 0.

    python -m pytest -q tests/unit/test_help.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from workbench.config import commandline
from workbench.export import __main__ as export_cli


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_workbench_help_lists_groups_examples_and_docs():
    r = run("workbench", "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = r.stdout
    assert out.startswith("usage: python -m workbench ")
    for group in ("method", "model", "peft", "backend", "env", "reward", "debug", "experiment", "hardware"):
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [group])
        assert [c.rstrip("*,") for c in line.split()[1:] if not c.startswith("(")][:len(commandline.choices(group))] == \
            commandline.choices(group), line
    assert "_schema" not in out and "sft*" in out and "smollm2-135m*" in out
    assert "== Configuration groups ==" not in out  # not Hydra's page
    assert sum(ln.startswith("  python -m workbench") for ln in out.splitlines()) == 10
    assert str(ROOT / "docs") in out and (ROOT / "docs" / "index.md").exists()


def test_short_flag_is_the_same_page():
    assert run("workbench", "-h").stdout == commandline.usage() + "\n"


@pytest.mark.parametrize("command", [c for c, _ in commandline.EXAMPLES])
def test_every_example_composes(command):
    """Each example as written names existing groups, choices and keys (a sweep: at every value)."""
    assert commandline.precheck(command.split()[3:]) is None


def test_export_help_exits_0_with_its_usage():
    r = run("workbench.export", "--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: python -m workbench.export <run_dir>")


def test_export_without_a_run_dir_is_a_usage_error(capsys):
    assert export_cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ") and "error: the first argument is the run directory" in err


def test_export_of_a_missing_step_names_the_steps_there_are(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("{}\n")
    for step in (4, 8):
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
    assert export_cli.main([str(tmp_path), "step=1"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path}: no checkpoint at step 1; steps saved: 4, 8"
    assert export_cli.main([str(tmp_path), "step=last"]) == 2
    assert "error: step='last': a checkpoint's step number; steps saved: 4, 8" in capsys.readouterr().err


def test_export_writes_only_under_the_run_and_prints_where(tmp_path, capsys, monkeypatch):
    """Hydra's run directory is the export's own (no ./outputs/<date>/ where the command was typed)."""
    (tmp_path / "config.yaml").write_text("{}\n")
    (tmp_path / "checkpoints" / "step-00000004").mkdir(parents=True)
    monkeypatch.setattr(export_cli.checkpoint, "verify", lambda path: None)
    calls = []
    monkeypatch.setattr(export_cli.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert export_cli.main([str(tmp_path), "step=4"]) == 0
    out = tmp_path / "exports" / "step-00000004"
    assert f"output_dir={out}" in calls[0] and f"hydra.run.dir={out}" in calls[0]
    assert capsys.readouterr().out.strip() == f"exported step 4: {out / 'export'}"
