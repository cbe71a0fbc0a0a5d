"""A dry run refuses what the real run refuses, with the same line: each bad input below goes
through the real entry point twice, `python -m workbench ... dry_run=true` and the same command
without it, and both must exit 2 with one identical `error:` line. The real run must say it
before loading weights: the CLI prints `precision: ...` once preflight has passed, right before
the run builds its model, so a refusal printed without that line came from preflight (or earlier).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_dry_run_agrees.py            # fast half
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/unit/test_dry_run_agrees.py    # the rest

Each command is a fresh Python process (~7 s of CPU on the tiny model, mostly imports), so the
cases whose checks are older than this test, and two of the new ones, are marked slow (the default
tier keeps an import check and the keep_best check).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY


def case(name: str, overrides: list[str], fragment: str, slow: bool = False):
    """A bad input: its overrides and a fragment the error line must contain."""
    return pytest.param(overrides, fragment, id=name, marks=[pytest.mark.slow] if slow else [])


CASES = [
    case("reward-module-missing", ["method=grpo", "reward.functions=[nosuchmod:score]"],
         "reward: cannot import module 'nosuchmod' for 'nosuchmod:score'"),
    case("reward-function-missing", ["method=grpo", "reward.functions=[json:nosuch]"],
         "reward: module 'json' has no function 'nosuch'", slow=True),
    case("keep-best-metric-missing", ["data.eval_split=4", "eval.tasks=[loss]", "train.keep_best=loss/los"],
         "train.keep_best='loss/los': no task in eval.tasks=['loss'] reports that metric; did you mean loss/loss?"),
    case("eval-hook-missing", ["eval.tasks=[nosuchmod:score]"],
         "eval.tasks: cannot import module 'nosuchmod' for 'nosuchmod:score'", slow=True),
    case("dpo-beta", ["method=dpo", "method.beta=-1"], "method.beta must be > 0", slow=True),
    case("max-steps-negative", ["train.max_steps=-1"], "train.max_steps", slow=True),
    case("data-path-missing", ["data.path=no/such/rows.jsonl"], "no/such/rows.jsonl", slow=True),
    case("grpo-without-reward", ["method=grpo", "~reward"], "method=grpo needs", slow=True),
]


def _run(overrides: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "workbench", *TINY, *overrides], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(("overrides", "fragment"), CASES)
def test_dry_run_and_real_run_refuse_alike(overrides, fragment, tmp_path):
    dry = _run([*overrides, "dry_run=true"], tmp_path)
    real = _run(overrides, tmp_path)
    shown = f"\n--- dry run:\n{dry.stdout[-1500:]}{dry.stderr[-1500:]}\n--- real run:\n{real.stdout[-1500:]}{real.stderr[-1500:]}"
    assert (dry.returncode, real.returncode) == (2, 2), shown
    assert len(_errors(dry)) == 1 and _errors(dry) == _errors(real), shown
    assert fragment in _errors(real)[0], shown
    assert "Traceback" not in real.stderr + dry.stderr, shown
    # refused before the weights: preflight never passed, no step ran
    assert "precision:" not in real.stderr and "step " not in real.stdout, shown
