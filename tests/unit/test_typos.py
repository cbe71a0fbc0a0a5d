"""Typos on the command line: every config group refuses an unknown choice with its options, and
an unknown key gets the closest existing one as an override that composes, in one `error:` line
with status 2, before anything is built.

    python -m pytest -q tests/unit/test_typos.py
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from workbench.config import commandline


def refusal(argv: list[str], capsys) -> str:
    """The one line `python -m workbench <argv>` stops with (the CLI's own composition check;
    the command line prints it as `error: ...` and exits 2: test_cli_stops_before_the_run_with_one_line)."""
    mistake = commandline.precheck(argv)
    assert mistake is not None and "\n" not in mistake and "Traceback" not in mistake, mistake
    return f"error: {mistake}"


def composes(argv: list[str]) -> None:
    assert commandline.precheck(argv) is None


@pytest.mark.parametrize("typo, choices, closest", [
    ("debug=fats", "fast, overfit", "debug=fast"),
    ("env=calculator", "calc", None),
    ("reward=arith_exat", "arith_digits, arith_exact", "reward=arith_exact"),
    ("experiment=arith_ful", "arith_full", "experiment=arith_full"),
    ("method=dpoo", "cpo, distill, dpo", "method=dpo"),
])
def test_unknown_choice_is_refused_with_the_options(typo, choices, closest, capsys):
    line = refusal(["model=tiny", typo], capsys)
    assert line.startswith(f"error: {typo}: no such choice") and choices in line
    assert "_schema" not in line
    if closest:
        assert f"did you mean {closest}?" in line
        composes(["model=tiny", closest])
    else:
        assert "did you mean" not in line


def test_every_group_refuses_an_unknown_choice(capsys):
    """No group is optional: an `optional` group in conf/train.yaml would compose without a word."""
    for group in commandline.groups():
        line = refusal([f"{group}=no_such_choice"], capsys)
        assert f"{group}=no_such_choice: no such choice" in line
        assert ", ".join(commandline.choices(group)) in line, line


@pytest.mark.parametrize("typo, fix", [
    ("train.max_step=3", "train.max_steps=3"),
    ("optim.lrr=1e-4", "optim.lr=1e-4"),
    ("trian.max_steps=3", "train.max_steps=3"),
    ("methd=dpo", "method=dpo"),
    ("evn=calc", "env=calc"),
])
def test_unknown_key_names_the_closest_one(typo, fix, capsys):
    line = refusal(["model=tiny", typo], capsys)
    assert line == f"error: {typo.split('=')[0]} is not a config key; did you mean {fix}?"
    assert "+" not in line  # Hydra's `+key=` hint only fails later, in validation
    composes(["model=tiny", "method=grpo", fix] if fix.startswith("env") else ["model=tiny", fix])


def test_key_of_the_chosen_method_is_suggested(capsys):
    """The keys are looked up in the config the command line's group choices compose."""
    assert refusal(["method=dpo", "method.betaa=0.2"], capsys).endswith("did you mean method.beta=0.2?")


def test_unknown_key_without_a_close_one_lists_the_section(capsys):
    line = refusal(["train.zzzzz=1"], capsys)
    assert "did you mean" not in line and re.search(r"keys under train: .*max_steps", line)


@pytest.mark.parametrize("group", ["env", "debug", "experiment", "reward"])
def test_null_unsets_a_group(group, capsys):
    argv = commandline.nulls_as_deletions(["method=grpo", f"{group}=null"])
    assert argv[-1] == f"~{group}"
    composes(argv)
    assert commandline.nulls_as_deletions(["train.keep_best=null"]) == ["train.keep_best=null"]  # a value, not a group


def test_a_sweep_is_checked_at_every_value_before_the_first_job(capsys):
    line = refusal(["-m", "model=tiny", "optim.lr=1e-4,3e-4", "debug=fast,fats"], capsys)
    assert line.startswith("error: debug=fats: no such choice")
    assert refusal(["--multirun", "train.max_step=1,2"], capsys).endswith("did you mean train.max_steps=1,2?")
    composes(["-m", "optim.lr=1e-4,3e-4", "peft=lora,dora"])
    composes(["-m", "hydra/sweeper=optuna", "optim.lr=interval(1e-5,1e-3)"])  # not listable: Hydra's sweeper checks it


def test_cli_stops_before_the_run_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "workbench", "model=tiny", "debug=fats", f"output_dir={tmp_path}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: debug=fats: no such choice (conf/debug/fats.yaml); did you mean debug=fast? "
        "available options: fast, overfit"]
    assert not any(tmp_path.iterdir())
