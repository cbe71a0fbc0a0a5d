"""Deterministic weighted mixing, realised proportions, and exact resume of the data position.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_mixing.py
"""

from __future__ import annotations

import pytest

from tests.tolerances import mix_share_atol
from workbench.data.mixing import Mixture, rank_share
from workbench.data.packing import Packer


def draws(m: Mixture, n: int):
    return [m.next() for _ in range(n)]


def test_same_seed_same_order_other_seed_other_order():
    a = draws(Mixture([50, 70, 30], [0.5, 0.3, 0.2], seed=3), 500)
    b = draws(Mixture([50, 70, 30], [0.5, 0.3, 0.2], seed=3), 500)
    c = draws(Mixture([50, 70, 30], [0.5, 0.3, 0.2], seed=4), 500)
    assert a == b and a != c


def test_realised_weights_within_the_credit_bound_on_10k():
    weights = [0.6, 0.25, 0.1, 0.05]
    m = Mixture([1000, 37, 5000, 3], weights, seed=0)
    got = draws(m, 10_000)
    for i, w in enumerate(weights):
        share = sum(1 for s, _ in got if s == i) / len(got)
        assert abs(share - w) <= mix_share_atol(len(weights), len(got)), (i, share, w)
        assert m.realised()[i] == share  # the same count over the same total


def test_every_row_once_per_epoch():
    m = Mixture([7, 13], [1.0, 1.0], seed=1)
    got = draws(m, 26)
    first = [r for s, r in got if s == 0]
    assert len(first) == 13 and sorted(first[:7]) == list(range(7))  # a whole epoch before any repeat
    assert sorted(r for s, r in got if s == 1) == list(range(13))


def test_resume_continues_at_the_exact_next_row():
    ref = draws(Mixture([11, 5, 23], [0.2, 0.5, 0.3], seed=9), 300)
    for cut in (0, 1, 37, 150, 299):
        m = Mixture([11, 5, 23], [0.2, 0.5, 0.3], seed=9)
        head = draws(m, cut)
        state = m.state_dict()
        fresh = Mixture([11, 5, 23], [0.2, 0.5, 0.3], seed=9)
        fresh.load_state_dict(state)
        assert head + draws(fresh, 300 - cut) == ref  # no row read twice, none skipped


def test_every_rank_draws_the_global_batch_and_keeps_its_slice():
    """rank_share: the data-parallel rank and size come from the layout (4 processes at tp=2 are 2
    data-parallel ranks; tensor-parallel peers get the same rows), the slices partition the global
    batch, and every rank's mixture ends in the same position (what a checkpoint holds)."""
    from workbench.train.layout import Layout

    whole = Mixture([11, 5, 23], [0.2, 0.5, 0.3], seed=9).take(12)
    slices, states = [], []
    for rank in range(4):
        m = Mixture([11, 5, 23], [0.2, 0.5, 0.3], seed=9)
        drawn, mine = rank_share(Layout(rank=rank, world=4, tp=2), 6, m.take)
        assert drawn == whole
        slices.append(mine)
        states.append(m.state_dict())
    assert slices[0] == slices[1] == whole[:6] and slices[2] == slices[3] == whole[6:]
    assert all(st == states[0] for st in states)
    with pytest.raises(ValueError, match="global batch of 6 x 2"):
        rank_share(Layout(rank=0, world=2), 6, lambda n: list(range(n - 1)))


def test_packer_resume_reads_no_row_twice_and_skips_none():
    sizes = [40, 25]
    lens = {(s, r): 5 + (r * 7 + s * 3) % 40 for s in range(2) for r in range(max(sizes))}

    def stream(cut_step=None, steps=12):
        m = Mixture(sizes, [0.7, 0.3], seed=2)
        p = Packer(m, lambda x: lens[x], 64)
        out = []
        for step in range(steps):
            if step == cut_step:  # save, rebuild from nothing, load
                st_m, st_p = m.state_dict(), p.state_dict()
                m = Mixture(sizes, [0.7, 0.3], seed=2)
                p = Packer(m, lambda x: lens[x], 64)
                m.load_state_dict(st_m)
                p.load_state_dict(st_p)
            out.append(p.next_rows(3))
        return out, m, p

    ref, m, p = stream()
    for cut in (1, 5, 11):
        assert stream(cut)[0] == ref
    # every drawn example is either trained exactly once or still waiting in the carry
    trained = [x for step in ref for row in step for x in row]
    drawn = sum(m.taken)
    assert len(trained) + len(p.carry) == drawn
    for step in ref:
        assert len(step) == 3 and all(sum(lens[x] for x in row) <= 64 for row in step)


def test_recipe_mix_of_every_format_follows_its_weights(tmp_path):
    from tests.helpers import data_cfg, tiny_tokenizer
    from workbench.data.pipeline import tokenise_recipe
    from workbench.data.recipes import load_recipe

    tokenizer, contract = tiny_tokenizer()
    recipe = load_recipe("formats_demo")
    sources = tokenise_recipe(recipe, tokenizer, contract, data_cfg(tmp_path))
    assert [s.source.name for s in sources] == ["chat", "sharegpt", "alpaca", "qa", "parquet", "text"]
    m = Mixture([len(s.examples) for s in sources], [s.source.weight for s in sources], seed=0)
    draws(m, 5000)
    total = sum(s.source.weight for s in sources)
    for s, got in zip(sources, m.realised()):
        assert abs(got - s.source.weight / total) <= mix_share_atol(len(sources), 5000), s.source.name
