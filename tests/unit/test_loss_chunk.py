"""model.loss_chunk: target log-probs computed a piece of positions at a time (workbench/models/head.py).

    .venv/bin/python -m pytest -q tests/unit/test_loss_chunk.py

The pieces run the same head, log-softmax and gather on the same rows, so log-probs, entropies
and every gradient element equal the one-piece computation up to the order of the sums in the
backward (LOSS_RTOL, scale_atol: tests/tolerances.py). The memory test reads the torch CPU
allocator's peak (workbench/plan/tensor_memory.py) over a forward and backward of a
131,072-token vocabulary at 1,024 positions: one piece holds the (positions x vocabulary) fp32
logits, their log-softmax and a gradient at once (1.5 GiB), pieces of 128 an eighth of that.
"""

from __future__ import annotations

import pytest
import torch

from tests.tolerances import LOSS_RTOL, scale_atol
from workbench.models.head import SelectiveLM


def llama(vocab: int = 512, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=16, attn_implementation="sdpa",
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def batch(vocab: int, rows: int = 3, seq: int = 40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    select = torch.rand(rows, seq, generator=g) < 0.6
    select[:, -1] = False
    targets = ids[:, 1:][select[:, :-1]]
    return ids, select, targets


def run(lm, ids, select, targets, **kw):
    lm.zero_grad(set_to_none=True)
    out = lm(input_ids=ids, select=select, targets=targets, **kw)
    logp = out[0] if isinstance(out, tuple) else out
    (logp * torch.linspace(-1, 1, logp.numel())).sum().backward()
    return out, {n: p.grad.clone() for n, p in lm.named_parameters()}


@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7, "entropy": True}, {"slot": "tree"}])
def test_pieces_equal_one_piece(kw):
    model = llama()
    ids, select, targets = batch(512)
    if kw.get("slot") == "tree":  # a tree row reads a position twice: slot maps targets to read positions
        n = int(select.sum())
        slot = torch.cat([torch.arange(n), torch.tensor([0, n - 1])])
        kw = {"slot": slot}
        targets = torch.cat([targets, targets[:1], targets[-1:]])
    whole, g_whole = run(SelectiveLM(model), ids, select, targets, **kw)
    piece, g_piece = run(SelectiveLM(model, chunk=7), ids, select, targets, **kw)
    for a, b in zip(whole if isinstance(whole, tuple) else (whole,), piece if isinstance(piece, tuple) else (piece,)):
        assert a.shape == b.shape == targets.shape
        a, b = a.detach(), b.detach()
        torch.testing.assert_close(b, a, rtol=LOSS_RTOL, atol=scale_atol(a))
    for k, ref in g_whole.items():
        torch.testing.assert_close(g_piece[k], ref, rtol=0, atol=scale_atol(ref), msg=k)


def test_logps_equal_the_logits_path():
    """With targets, the log-probs are those the logits give (what the methods read before)."""
    model = llama()
    ids, select, targets = batch(512)
    lm = SelectiveLM(model, chunk=5)
    with torch.no_grad():
        logits = lm(input_ids=ids, select=select)
        got = lm(input_ids=ids, select=select, targets=targets)
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=scale_atol(want))


def peak_bytes(lm, ids, select, targets) -> int:
    from workbench.plan.tensor_memory import Window

    window = Window()
    window.start()
    lm(input_ids=ids, select=select, targets=targets).sum().backward()
    return window.stop()


def test_pieces_do_not_hold_the_vocabulary_wide_logits():
    vocab, seq = 131_072, 1024
    model = llama(vocab=vocab, hidden=32)
    for p in model.model.layers.parameters():
        p.requires_grad_(False)  # the head and embedding train: the logits' memory is what differs
    ids = torch.randint(0, vocab, (1, seq))
    select = torch.ones(1, seq, dtype=torch.bool)
    select[:, -1] = False
    targets = ids[:, 1:].reshape(-1)
    whole = peak_bytes(SelectiveLM(model), ids, select, targets)
    model.zero_grad(set_to_none=True)
    piece = peak_bytes(SelectiveLM(model, chunk=128), ids, select, targets)
    logits = (seq - 1) * vocab * 4  # one fp32 copy of the whole logits: 0.5 GiB
    assert whole > 2 * logits  # logits, log-softmax and a gradient alive at once
    assert piece < whole - 2 * logits, (piece, whole)  # at most a piece's (an eighth) of them
