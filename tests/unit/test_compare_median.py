"""`python -m workbench.report`'s throughput is the median over each run's steps, not one step's.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_compare_median.py
"""

from __future__ import annotations

import json

import pytest

from workbench.telemetry import compare


def _run(path, tokens_per_s: list[float]) -> None:
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("model:\n  name: tiny\noptim:\n  lr: 0.0001\n")
    rows = [{"step": i + 1, "loss": 2.0 - 0.1 * i, "tokens": 198, "tokens_per_s": tps, "mfu": tps / 100_000}
            for i, tps in enumerate(tokens_per_s)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _speed(table: str) -> list[tuple[str, str]]:
    lines = [line for line in table.splitlines() if line.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return [(c[head.index("tokens/s (median)")], c[head.index("MFU (median)")]) for c in cells]


def test_two_identical_runs_whose_last_steps_differ_compare_alike(tmp_path):
    """The same job twice, one's last step ten times as fast: the comparison's throughput is each
    run's median over its steps, the same for both (the last step's would be 1926 and 19260)."""
    _run(tmp_path / "a", [600.0, 1926.0, 1926.0])
    _run(tmp_path / "b", [600.0, 1926.0, 19260.0])
    table, _ = compare.compare([str(tmp_path / "a"), str(tmp_path / "b")])
    assert _speed(table) == [("1926", "1.9%"), ("1926", "1.9%")]


def test_the_median_leaves_out_the_first_step_only_when_three_remain():
    rows = [{"tokens_per_s": v} for v in (10.0, 100.0, 102.0, 101.0, 5000.0)]
    assert compare.step_median(rows, "tokens_per_s") == pytest.approx(101.5)  # of the last four
    assert compare.step_median(rows[:3], "tokens_per_s") == 100.0  # of all three
    assert compare.step_median(rows[:2], "tokens_per_s") == pytest.approx(55.0)  # of both, not the last alone
    assert compare.step_median([{"loss": 1.0}], "tokens_per_s") is None
