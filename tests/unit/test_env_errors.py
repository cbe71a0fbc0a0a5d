"""Mistakes with environments end in one UserError naming the field, before any weights load.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_env_errors.py
"""

from __future__ import annotations

import pytest

from tests.unit.test_bad_input import no_weights, run  # noqa: F401 - the fixture refuses any weight load
from workbench.core.errors import UserError
from workbench.envs.base import ToolEnv


class BadSchema(ToolEnv):
    TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {"x": {"type": 7}}}}}]


class NotAnEnv:
    pass


GRPO = ["method=grpo", "env=calc"]
CASES = [
    ("env-with-sft", ["env=calc"], r"\[env-needs-grpo\] env=calc runs multi-turn episodes for method=grpo"),
    ("unknown-env", [*GRPO, "env.name=chess"], r"env.name='chess': unknown environment"),
    ("bad-tool-schema", [*GRPO, "env.name=tests.unit.test_env_errors:BadSchema"],
     r"TOOLS\[0\].function.parameters: not a valid JSON schema"),
    ("not-an-environment", [*GRPO, "env.name=tests.unit.test_env_errors:NotAnEnv"], r"is not a subclass of"),
    ("max-turns", [*GRPO, "env.max_turns=0"], r"env.max_turns must be >= 1"),
    ("tool-format", [*GRPO, "env.tool_format=xml"], r"env.tool_format='xml' is not one of"),
    ("episode-reward-without-env", ["method=grpo", "reward=final_answer"], r"\[env-rewards-need-env\]"),
    ("env-eval-without-env", ["method=grpo", "eval.tasks=[env]"], r"eval.tasks: 'env' evaluates episodes"),
    ("async-fsdp2", [*GRPO, "method.async_rollouts=true", "backend=fsdp2", "hardware.procs=2"],
     r"\[async-rollouts-one-process\]"),
    ("async-kl-in-reward", [*GRPO, "method.async_rollouts=true", "method.beta=0.1", "method.kl_in_reward=true"],
     r"\[async-rollouts-kl-in-reward\]"),
]


@pytest.mark.parametrize("overrides,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_env_mistakes_stop_before_weights(tmp_path, overrides, match):
    with pytest.raises(UserError, match=match):
        run(overrides, tmp_path)
