"""Every golden loss curve in tests/golden.py reproduces, on any x86 CPU and thread count.

Curves change only through scripts/update_golden.py.

Tolerances (tests/tolerances.py derives them): rtol LOSS_RTOL for every case; GRPO, whose
losses are signed means of cancelling terms of size ~1, also gets the absolute NEAR_ZERO_ATOL.
The GRPO completions themselves repeat across machines because rollouts sample by Gumbel-max
(workbench/rollout/generate.py says why).
"""

from __future__ import annotations

import pytest

from tests import golden
from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL


@pytest.mark.parametrize("case", sorted(golden.CASES))
def test_golden_curve(case, tmp_path):
    expected = golden.load(case)
    assert expected["overrides"] == golden.CASES[case], "case changed: regenerate with scripts/update_golden.py"
    got = golden.run_case(case, tmp_path)
    assert len(got) == len(expected["losses"]) == 4
    atol = NEAR_ZERO_ATOL if case.startswith("grpo") else 0.0
    assert got == pytest.approx(expected["losses"], rel=LOSS_RTOL, abs=atol)
