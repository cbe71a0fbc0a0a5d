"""Every golden loss curve in tests/golden.py reproduces (fp32, fixed seed, rtol 1e-5).

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
    assert got == pytest.approx(expected["losses"], rel=1e-5)
