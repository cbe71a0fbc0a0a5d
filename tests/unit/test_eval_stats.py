"""Wilson 95% intervals: the published values, and one beside every accuracy a run reports.

    .venv/bin/python -m pytest -q tests/unit/test_eval_stats.py
"""

from __future__ import annotations

import pytest

from workbench.evals.stats import intervals, wilson


@pytest.mark.parametrize("k, n, lo, hi", [
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I, method 3
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718),
    (90, 100, 0.8256, 0.9448), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
])
def test_wilson_matches_published_values(k, n, lo, hi):
    got = wilson(k, n)
    assert got == pytest.approx((lo, hi), abs=5e-5)


def test_wilson_narrows_with_more_questions_and_refuses_none():
    a, b = wilson(90, 100), wilson(180, 200)
    assert a[0] < b[0] < 0.9 < b[1] < a[1]
    with pytest.raises(ValueError):
        wilson(0, 0)


def test_intervals_sit_beside_accuracies_that_know_their_n():
    res = {"eval/arith_add2/accuracy": 0.9, "eval/arith_add2/n": 100, "eval/arith_add2/seconds": 3.0,
           "eval/preference/logp_accuracy": 0.5, "eval/preference/n": 20,
           "eval/mine/accuracy": 0.7,  # a user's hook without a count: no interval to give
           "eval/loss/loss": 1.2, "eval/loss/n": 10, "samples": {}}
    assert intervals(res) == {"eval/arith_add2/accuracy_ci95": [0.8256, 0.9448],
                              "eval/preference/logp_accuracy_ci95": [0.2993, 0.7007]}


def test_results_json_and_the_report_carry_the_interval(tmp_path):
    """results.json puts the interval beside each accuracy measured on n questions, and the report
    prints it after the number; the results the run returns stay {metric: number}."""
    import json
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from workbench.telemetry import report

    cfg = OmegaConf.create({"method": {"name": "sft"}, "model": {"name": "tiny"}, "backend": {"name": "single"},
                            "train": {"plots": False}})
    run = SimpleNamespace(cfg=cfg, peft=SimpleNamespace(kind="lora"), precision=SimpleNamespace(name="fp32"))
    results = {"eval_start": {"eval/arith_add2/accuracy": 0.0, "eval/arith_add2/n": 100},
               "eval_end": {"eval/arith_add2/accuracy": 0.9, "eval/arith_add2/n": 100, "eval/mine/accuracy": 0.5},
               "eval_during": [{"step": 5, "eval/arith_add2/accuracy": 0.5, "eval/arith_add2/n": 10}],
               "losses": [1.0, 0.5]}
    report.write(tmp_path, run, results, [])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["eval_end"]["eval/arith_add2/accuracy_ci95"] == [0.8256, 0.9448]
    assert saved["eval_end"]["eval/arith_add2/accuracy"] == 0.9  # the consumers' key, unchanged
    assert saved["eval_start"]["eval/arith_add2/accuracy_ci95"] == [0.0, 0.037]
    assert saved["eval_during"][0]["eval/arith_add2/accuracy_ci95"] == [0.2366, 0.7634]
    assert "eval/mine/accuracy_ci95" not in saved["eval_end"]  # no n, no interval
    assert not any(k.endswith("_ci95") for k in results["eval_end"])
    text = (tmp_path / "report.md").read_text()
    assert "| arith_add2 | 0.0% [0.0%, 3.7%] | 90.0% [82.6%, 94.5%] |" in text and "| mine | - | 50.0% |" in text
