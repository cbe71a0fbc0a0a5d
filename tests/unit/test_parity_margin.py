"""The parity gate judges what rounding can and cannot change (workbench/export/parity.py).

Where the reference's greedy completion and the exported file's part, the reference's margin
there (its own next token's log-probability minus the candidate's) is compared with what this
export's rounding moves the gap between two logits by (twice the largest |logit| difference on
the prompt positions). A margin within that reach is a near-tie: reported, not failed, even for a
format whose greedy answers must match (f16). A large margin is a real disagreement and fails.

The models here are lookup tables (the logits at a position depend on its token alone), so the
margins are set exactly; the tokenizer and the generator are stood in for.

    .venv/bin/python -m pytest -q tests/unit/test_parity_margin.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from workbench.export import parity

V = 8  # vocabulary
NOISE = 5e-4  # what the "rounding" moves each logit by: the reach is twice this


def test_margins_are_read_from_the_reference_logits():
    logits = torch.tensor([0.0, 3.0, 2.999, -1.0])
    m = parity.margins(logits, ref_token=1, cand_token=2)
    assert m["margin"] == pytest.approx(0.001, abs=1e-5) and m["top_gap"] == pytest.approx(0.001, abs=1e-5)
    m = parity.margins(logits, ref_token=1, cand_token=3)  # the candidate took the third choice
    assert m["margin"] == pytest.approx(4.0, abs=1e-5) and m["top_gap"] == pytest.approx(0.001, abs=1e-5)


def test_near_ties_are_reported_and_large_margins_fail():
    tie = {"prompt": 3, "position": 1, **parity.margins(torch.tensor([2.0, 2.0005, 0.0]), 1, 0)}
    real = {"prompt": 7, "position": 0, **parity.margins(torch.tensor([0.0, 5.0, 0.0]), 1, 0)}
    reach = 2 * NOISE
    judged = parity.judge_greedy([tie], reach)
    assert judged["passed"] and [d["prompt"] for d in judged["near_ties"]] == [3] and not judged["disagreements"]
    judged = parity.judge_greedy([tie, real], reach)
    assert not judged["passed"] and [d["prompt"] for d in judged["disagreements"]] == [7]
    assert [d["prompt"] for d in judged["near_ties"]] == [3] and judged["disagreements"][0]["reach"] == reach


class Table(torch.nn.Module):
    """A causal LM whose logits at each position are row `token` of a table; `answers` is what
    its greedy generation returns (the stand-in generator reads it)."""

    def __init__(self, table: torch.Tensor, answers: list[list[int]]):
        super().__init__()
        self.table, self.answers = table, answers

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=self.table[input_ids])


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(parity, "prompt_ids", lambda tokenizer, conv: list(conv))
    monkeypatch.setattr(parity, "generate", lambda model, tok, convs, n, eot, autocast=None: model.answers)


def pair(margin: float) -> tuple[Table, Table]:
    """The reference prefers token 5 over 6 after token 4 by `margin`; the candidate (every logit
    moved by at most NOISE, as rounding moves them) answers 6 there."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(V, V, generator=g) * 3
    ref[4, 5], ref[4, 6] = 10.0, 10.0 - margin
    signs = torch.where(torch.rand(V, V, generator=g) < 0.5, -1.0, 1.0)
    cand = ref + NOISE * signs
    prompts_answers = [[4, 5], [7]]  # prompt 0 parts at its first generated token
    return Table(ref, prompts_answers), Table(cand, [[4, 6], [7]])


PROMPTS = [[1, 2, 3, 4], [2, 3]]


def test_a_near_tie_does_not_fail_a_lossless_format(stand_ins):
    ref, cand = pair(margin=NOISE / 2)
    report = parity.compare(ref, cand, None, PROMPTS, eot_id=0, kind="f16", max_new_tokens=4)
    assert report["greedy_equal"] == 1 and report["greedy_must_match"]
    assert report["greedy_near_ties"] == 1 and report["greedy_disagreements"] == 0, report
    assert report["near_ties"][0]["prompt"] == 0 and report["near_ties"][0]["margin"] == pytest.approx(NOISE / 2, rel=1e-2)
    assert report["rounding_reach"] == pytest.approx(2 * NOISE, rel=1e-3)
    assert report["kl_mean"] <= report["kl_tolerance"] and report["passed"], report


def test_a_real_disagreement_still_fails(stand_ins):
    ref, cand = pair(margin=5.0)
    report = parity.compare(ref, cand, None, PROMPTS, eot_id=0, kind="f16", max_new_tokens=4)
    assert report["kl_mean"] <= report["kl_tolerance"]  # the KL alone would pass it
    assert report["greedy_disagreements"] == 1 and report["greedy_near_ties"] == 0
    assert report["disagreements"][0]["margin"] == pytest.approx(5.0, rel=1e-3)
    assert not report["passed"], report
    # a format whose greedy answers may differ reports it and passes
    assert parity.compare(ref, cand, None, PROMPTS, eot_id=0, kind="bf16", max_new_tokens=4)["passed"]
