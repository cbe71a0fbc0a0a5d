"""scripts/rm_probe.py: its probe finds a linear signal where there is one and none in noise, and
its features read each completion's own last token (or other read-out) and log-prob through right padding.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_rm_probe.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.tolerances import LOSS_RTOL, binomial_band, difference_atol, scale_atol
from workbench.data.preference import Pair

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("rm_probe", ROOT / "scripts" / "rm_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_separates_a_linear_signal_and_not_noise():
    rm_probe = _script()
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(64, generator=g)
    signal = lambda n: torch.randn(n, 64, generator=g) + 0.5 * direction  # noqa: E731
    assert rm_probe.probe(signal(600), signal(400)) > 0.95
    # 400 held-out pairs of pure noise: accuracy 0.5 with a standard deviation of 0.025
    low, high = binomial_band(0.5, 400)  # 0.4 .. 0.6
    assert low < rm_probe.probe(torch.randn(600, 64, generator=g), torch.randn(400, 64, generator=g)) < high


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


IGN = -100
PAIRS = [Pair(([1, 2, 3, 4], [IGN, IGN, 3, 4]), ([1, 2, 5, 6, 7], [IGN, IGN, 5, 6, 7]), 2),
         Pair(([8, 9, 10], [IGN, 9, 10]), ([8, 11, 12], [IGN, 11, 12]), 1)]


def _alone(model, seq, readout: str):
    """One completion's read-out and summed log-prob from an unpadded forward of it alone."""
    ids, labels = seq
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    lp = torch.log_softmax(out.logits[0, :-1], -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    kept = torch.tensor(labels[1:]) != IGN
    completion = torch.tensor(labels) != IGN
    if readout == "mean":
        h = torch.stack([x[0, completion].mean(0) for x in out.hidden_states])
    else:
        h = torch.stack([x[0, -1 - int(readout[5:] or 0)] for x in out.hidden_states])
    return h, float(lp[kept].sum())


def test_features_read_each_completions_last_token_through_padding():
    rm_probe, model = _script(), _tiny_llama()
    diffs, margins = rm_probe.features(model, PAIRS, pad_id=0)
    assert diffs.shape == (2, 3, 32)  # pairs, embeddings + 2 layers, hidden
    for i, p in enumerate(PAIRS):
        (hc, lc), (hr, lr) = _alone(model, p.chosen, "last"), _alone(model, p.rejected, "last")
        # a padded batch against each completion alone: the same sums in another order; the
        # read-outs and margins are differences, so they carry the rounding of what they subtract
        torch.testing.assert_close(diffs[i], hc - hr, rtol=LOSS_RTOL, atol=scale_atol(torch.stack([hc, hr])))
        assert float(margins[i]) == pytest.approx(lc - lr, rel=LOSS_RTOL, abs=difference_atol(lc, lr))


def test_other_readouts_read_their_positions_through_padding():
    rm_probe, model = _script(), _tiny_llama()
    for readout in ("last-1", "mean"):
        diffs, _ = rm_probe.features(model, PAIRS, pad_id=0, readout=readout)
        for i, p in enumerate(PAIRS):
            (hc, _), (hr, _) = _alone(model, p.chosen, readout), _alone(model, p.rejected, readout)
            torch.testing.assert_close(diffs[i], hc - hr, rtol=LOSS_RTOL, atol=scale_atol(torch.stack([hc, hr])),
                                       msg=readout)
