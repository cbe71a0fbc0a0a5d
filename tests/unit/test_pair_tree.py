"""method.share_prompt: one row per pair (workbench/data/pair_tree.py) gives two rows' log-probs and gradients.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_pair_tree.py

Tolerance: each per-row value is a sum of 3 to 31 completion-token log-probs, all of one sign,
added in the same order in both layouts; only the terms differ, by the rounding of attention
under another mask (a 4-D boolean mask instead of SDPA's causal path) and of the head's matmul
on another set of rows. Each term is a log-softmax over the vocabulary (16 ulps,
tests/tolerances.py), so the sums agree to LOSS_RTOL relative; gradients to grad_atol (LOSS_RTOL
times the largest element of the two-row gradient).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose, train
from tests.helpers import varied_pairs
from tests.tolerances import LOSS_RTOL, grad_atol
from workbench.data.chat import prompt_ids
from workbench.data.pair_tree import shared_prefix, tree_batch, tree_unsupported
from workbench.data.preference import Pair
from workbench.methods import logps


def _policy(peft: str):
    from workbench.models.head import SelectiveLM
    from workbench.models.load import load_model
    from workbench.peft import lora
    from workbench.resolve.derive import derive

    cfg = compose(["method=dpo", f"peft={peft}"])
    model = lora.apply(load_model(cfg.model), derive(cfg))
    if peft == "lora":  # B starts at zero; give the adapters a say in the output
        torch.manual_seed(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
    return SelectiveLM(model).train()


def _logps_and_grads(lm, micro, fn):
    lm.zero_grad(set_to_none=True)
    lp = fn(lm, micro)
    weights = torch.linspace(0.5, 1.5, lp.shape[0])  # every row, each with its own weight
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_tree_equals_two_rows(tiny, peft):
    pairs = varied_pairs(tiny)
    lm = _policy(peft)
    assert tree_unsupported(lm, 256) is None
    pad = tiny.tok.pad_token_id
    two, tree = logps.collate(pairs, pad), tree_batch(pairs, pad)
    want, want_g = _logps_and_grads(lm, two, logps.sequence_logps)
    got, got_g = _logps_and_grads(lm, tree, logps.tree_logps)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0.0)
    assert torch.equal(tree["n_tokens"], two["n_tokens"])  # ipo divides by these
    assert set(got_g) == set(want_g) and len(got_g) > 4
    for n, g in want_g.items():
        torch.testing.assert_close(got_g[n], g, rtol=LOSS_RTOL, atol=grad_atol(g))


def test_tree_is_smaller(tiny):
    pairs = varied_pairs(tiny)
    pad = tiny.tok.pad_token_id
    two, tree = logps.collate(pairs, pad), tree_batch(pairs, pad)
    n = len(pairs)
    assert tree["input_ids"].shape[0] == n and two["input_ids"].shape[0] == 2 * n
    assert tree["input_ids"].numel() < two["input_ids"].numel()
    assert tree["real_tokens"] < int(two["attention_mask"].sum())
    # the head runs once per position either branch reads: positions in the shared prefix (its
    # last one, and any completion tokens both share) serve both branches
    both = sum(sum(1 for t in range(shared_prefix(p.chosen[0], p.rejected[0]))
                   if p.chosen[1][t + 1] != -100 and p.rejected[1][t + 1] != -100) for p in pairs)
    assert both >= n
    assert int(tree["select"].sum()) == int(two["select"].sum()) - both
    assert tree["attention_mask"].shape == (n, 1, tree["input_ids"].shape[1], tree["input_ids"].shape[1])


def _replace(seq, at, token):
    ids, labels = list(seq[0]), list(seq[1])
    ids[at] = token
    if labels[at] != -100:
        labels[at] = token
    return ids, labels


@torch.no_grad()
def test_branches_do_not_see_each_other(tiny):
    """A changed chosen token moves the chosen log-prob, never the rejected one (and vice versa)."""
    pairs = varied_pairs(tiny)
    lm = _policy("none").eval()
    pad = tiny.tok.pad_token_id
    base = logps.tree_logps(lm, tree_batch(pairs, pad))
    n = len(pairs)
    for side in (0, 1):
        changed = []
        for p in pairs:
            s = shared_prefix(p.chosen[0], p.rejected[0])
            seqs = [p.chosen, p.rejected]
            token = next(t for t in range(100, 200) if t not in (p.chosen[0][s], p.rejected[0][s]))
            seqs[side] = _replace(seqs[side], s, token)  # the branch's first own token: the prefix stays
            changed.append(Pair(seqs[0], seqs[1], p.prompt_len))
        lp = logps.tree_logps(lm, tree_batch(changed, pad))
        mine, other = slice(side * n, (side + 1) * n), slice((1 - side) * n, (2 - side) * n)
        # moved far beyond rounding: 10x the tolerance within which equal sums agree
        assert ((lp[mine] - base[mine]).abs() > 10 * LOSS_RTOL * base[mine].abs()).all()
        torch.testing.assert_close(lp[other], base[other], rtol=LOSS_RTOL, atol=0.0)


def test_unsupported_models_keep_two_rows(tiny):
    lm = _policy("none")
    assert tree_unsupported(lm.inner, 256) is not None  # not a SelectiveLM
    lm._split = False
    assert "own forward" in tree_unsupported(lm, 256)
    lm._split = True
    lm.inner.config._attn_implementation = "eager"
    assert "eager" in tree_unsupported(lm, 256)
    lm.inner.config._attn_implementation = "sdpa"
    lm.inner.config.sliding_window, lm.inner.config.use_sliding_window = 128, True
    assert "sliding" in tree_unsupported(lm, 256) and tree_unsupported(lm, 128) is None


def test_training_curves_agree(tmp_path):
    """The whole step (adapter reference, next_batch) with and without share_prompt."""
    base = ["method=dpo", "peft=lora", "train.max_steps=2", "train.resume=never"]
    a = train(base + ["method.share_prompt=false"], tmp_path / "a")
    b = train(base + ["method.share_prompt=true"], tmp_path / "b")
    assert b["losses"] == pytest.approx(a["losses"], rel=LOSS_RTOL)
    assert len(set(a["losses"])) == 2  # the second step trained on changed weights


@pytest.mark.parametrize("first", [0, 2])
def test_grpo_branches_equal_one_row_per_completion(tiny, first):
    """GRPO's completions of one prompt as branches of one row (method.share_prompt): the same
    per-token log-probs and gradients as one row per completion, in the same flat order, with a
    micro-batch that starts inside a group (`first`), a completion repeated verbatim and an
    empty one (the end-of-turn token alone). Tolerance as test_tree_equals_two_rows."""
    from workbench.data.chat import IGNORE
    from workbench.methods import grpo

    tok, eot, G = tiny.tok, tiny.contract.end_of_turn_id, 3
    prompts = [prompt_ids(tok, [{"role": "user", "content": q}]) for q in ("What is 12 + 30?", "Add 4 and 5, then 7.")]
    texts = ["42", "4 2", "42", "", "sixteen", "1 6 and more words"]
    comps = [tok(t, add_special_tokens=False)["input_ids"] + [eot] for t in texts]
    seqs = [(prompts[i // G] + c, [IGNORE] * len(prompts[i // G]) + c) for i, c in enumerate(comps)][first:]
    lm = _policy("lora")
    pad = tok.pad_token_id
    rows, tree = grpo.collate(seqs, G, first, pad, tree=False), grpo.collate(seqs, G, first, pad, tree=True)
    assert tree["input_ids"].shape[0] == 2 and tree["real_tokens"] < rows["real_tokens"]
    assert torch.equal(tree["n_tokens"], rows["n_tokens"]) and torch.equal(tree["target_seq"], rows["target_seq"])
    assert torch.equal(tree["targets"], rows["targets"])

    def per_token(lm, micro):
        return grpo.token_logps(lm, micro, temperature=0.7)

    want, want_g = _logps_and_grads(lm, rows, per_token)
    got, got_g = _logps_and_grads(lm, tree, per_token)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=0.0)
    assert set(got_g) == set(want_g) and len(got_g) > 4
    for n, g in want_g.items():
        torch.testing.assert_close(got_g[n], g, rtol=LOSS_RTOL, atol=grad_atol(g))
