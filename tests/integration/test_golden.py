"""Every golden loss curve in tests/golden.py reproduces (fp32, fixed seed, rtol 1e-5, atol 1e-7).

Curves change only through scripts/update_golden.py.
"""

from __future__ import annotations

import pytest

from tests import golden


@pytest.mark.parametrize("case", sorted(golden.CASES))
def test_golden_curve(case, tmp_path):
    expected = golden.load(case)
    assert expected["overrides"] == golden.CASES[case], "case changed: regenerate with scripts/update_golden.py"
    got = golden.run_case(case, tmp_path)
    assert len(got) == len(expected["losses"]) == 4
    # rtol 1e-5; the 1e-7 absolute floor is for GRPO, whose on-policy losses sit near zero where
    # the thread count's summation order alone moves the relative error past 1e-5.
    assert got == pytest.approx(expected["losses"], rel=1e-5, abs=1e-7)
