"""backend.sp without processes: how a micro-batch is cut, what the rules refuse, what the planner counts.

    python -m pytest -q tests/unit/test_sequence_parallel.py

The parity of losses and gradients under real process groups is tests/distributed/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from workbench.core.errors import UserError
from workbench.data.collate import pack_rows, pad_batch
from workbench.resolve import rules
from workbench.train import sequence_parallel as sp


def ex(n: int, answer: int, start: int = 10):
    ids = list(range(start, start + n))
    return ids, [-100] * (n - answer) + ids[n - answer:]


def test_slices_cover_the_rows_and_keep_each_target_with_its_position():
    micro = pack_rows([[ex(5, 2), ex(4, 3, 50)], [ex(7, 7, 90)]], 0, "rows", "4d")  # width 9: padded to 10
    parts = [sp._slice(micro, 2, r) for r in range(2)]
    ids = torch.cat([p[0]["input_ids"] for p in parts], dim=1)
    assert ids.shape == (2, 10) and torch.equal(ids[:, :9], micro["input_ids"])
    # every target once, in order, on the rank whose slice holds the position that predicts it
    assert torch.equal(torch.cat([p[0]["targets"] for p in parts]).sort().values, micro["targets"].sort().values)
    for local, _ in parts:
        assert int(local["select"].sum()) == local["targets"].numel()
        assert local["attention_mask"] is None
    rows = parts[0][1]
    # documents restart where position ids do: row 0 holds two, row 1 one, then padding
    assert rows.doc[0, :9].tolist() == [1] * 5 + [2] * 4
    # the padding sp adds is never attended to; a packed row's own padding restarts its position
    # ids, so it is a document of its own that no real token reads
    assert rows.real[:, 9].tolist() == [False, False]
    assert rows.doc[1, 7] == rows.doc[1, 8] != rows.doc[1, 6]
    assert not rows.causal
    mask = rows.attend()[:, 0]
    assert not mask[0, 5, 4] and mask[0, 5, 5] and mask[0, 8, 5] and not mask[0, 4, 5]  # no attention across documents


def test_one_document_per_row_needs_no_mask():
    micro = pad_batch([ex(6, 2), ex(9, 3)], 0)
    _, rows = sp._slice(micro, 2, 0)
    assert rows.causal and rows.attend() is None


def test_heads_split_unevenly():
    assert sp.shares(9, 2) == [5, 4] and sp.shares(3, 2) == [2, 1] and sp.shares(4, 2) == [2, 2]


@pytest.mark.parametrize("overrides, rule", [
    (["backend.sp=2"], "sp-divides-procs"),
    (["backend.sp=2", "hardware.procs=2", "method=kto"], "sp-method"),
    (["backend.sp=8", "hardware.procs=8"], "sp-heads"),
    (["backend.sp=2", "hardware.procs=2", "model.attn_implementation=flash_attention_2"], "sp-attention"),
])
def test_rules_refuse_before_weights_load(overrides, rule):
    with pytest.raises(UserError, match=rf"\[{rule}\]"):
        rules.check(compose(overrides), rules.Env())


@pytest.mark.parametrize("backend", ["single", "fsdp2", "deepspeed"])
def test_sp_is_accepted_on_each_backend(backend):
    rules.check(compose([f"backend={backend}", "backend.sp=2", "hardware.procs=2"]), rules.Env(packages=frozenset({"deepspeed"})))


def test_planner_splits_tokens_not_the_batch():
    from workbench.plan.make import from_cfg, run_tokens
    from workbench.plan.memory import activation_bytes, logits_bytes

    one = compose(["data.seq_len=1024", "hardware.procs=2"])
    two = compose(["data.seq_len=1024", "hardware.procs=2", "backend.sp=2"])
    s1, s2 = from_cfg(one), from_cfg(two)
    assert (s1.dp, s1.data_parallel, s2.dp, s2.data_parallel) == (2, 2, 2, 1)  # sp ranks shard, they share rows
    assert run_tokens(two, s2) == run_tokens(one, s1) / 2  # half the rows per step, not the same rows twice
    arch = one.model.arch
    assert activation_bytes(arch, s2) == pytest.approx(activation_bytes(arch, s1) / 2)  # one row, no mask
    assert logits_bytes(arch, s2) == pytest.approx(logits_bytes(arch, s1) / 2)
