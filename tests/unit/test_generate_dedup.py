"""Shared-prefill rollouts (workbench/rollout/generate.py, dedup=True) sample exactly what HF's
plain path samples, and generation stops once every row has ended its turn.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_generate_dedup.py

The tiny model (random weights) is used for both paths in one process; exact equality is the
claim (GRPO's golden curves depend on the rollouts repeating), so there is no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose
from workbench.data.chat import prompt_ids
from workbench.rollout.generate import generate

G, NEW = 4, 10
# different prompt lengths (left padding differs per row) and one repeated prompt
TEXTS = ["What is 12 + 30?", "Hi", "What is 45 + 17? Answer with the number only, please.", "Hi", "7 + 8"]


@pytest.fixture(scope="module")
def tiny():
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer

    cfg = compose(["method=grpo", "peft=none"])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    return tok, contract.end_of_turn_id, load_model(cfg.model)


def _convs():
    return [[{"role": "user", "content": t}] for t in TEXTS]


def _run(model, tok, eot, dedup: bool, seed: int = 0, **kw):
    """Completions, and the (rows, columns) of every forward the call made."""
    shapes = []  # from the embedding, which every forward calls (PEFT calls the HF model's .forward directly)
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, o: shapes.append(tuple(a[0].shape)))
    try:
        torch.manual_seed(seed)
        out = generate(model, tok, _convs(), NEW, eot, do_sample=True, num_return_sequences=G, dedup=dedup, **kw)
    finally:
        hook.remove()
    return out, shapes


@pytest.mark.parametrize("peft", ["none", "lora"])
@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "top_p": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
def test_shared_prefill_samples_the_same_completions(tiny, peft, sampling):
    tok, eot, base = tiny
    model = base
    if peft == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    try:
        plain, plain_shapes = _run(model, tok, eot, dedup=False, **sampling)
        shared, shared_shapes = _run(model, tok, eot, dedup=True, **sampling)
    finally:
        if peft == "lora":
            model.unload()  # restore the shared base modules for the other cases
    width = max(len(prompt_ids(tok, c)) for c in _convs())
    distinct = len(set(TEXTS))
    assert plain_shapes[0] == (len(TEXTS) * G, width)  # HF prefills every repeated row
    assert shared_shapes[0] == (distinct, width - 1)  # one prefill per distinct prompt
    assert shared_shapes[1] == (len(TEXTS) * G, 1)  # then only the last prompt token per row
    assert len(plain) == len(TEXTS) * G
    # sampling really is on: a group's continuations differ, and the two "Hi" groups differ
    assert len({tuple(c) for c in plain[:G]}) > 1
    assert plain[G:2 * G] != plain[3 * G:4 * G]
    assert shared == plain


def test_another_seed_gives_other_completions(tiny):
    """The equality above is not vacuous: the completions depend on the seed."""
    tok, eot, model = tiny
    assert _run(model, tok, eot, dedup=True, seed=0)[0] != _run(model, tok, eot, dedup=True, seed=1)[0]


@pytest.mark.parametrize("dedup", [False, True])
def test_stops_when_every_row_has_ended(tiny, dedup):
    """HF's loop ends as soon as all rows produced the end-of-turn, not at max_new_tokens: a hook
    makes the end-of-turn certain from the third sampled token on."""
    tok, eot, model = tiny
    calls = []

    def force_eot(module, args, kwargs, output):
        calls.append(kwargs["input_ids"].shape)
        sampled = len(calls) - (1 if dedup else 0)  # the shared prefill samples nothing
        if sampled >= 3:
            output.logits[..., eot] = 1e4
        return output

    hook = model.register_forward_hook(force_eot, with_kwargs=True)
    try:
        torch.manual_seed(0)
        out = generate(model, tok, _convs(), NEW, eot, do_sample=True, num_return_sequences=G, dedup=dedup)
    finally:
        hook.remove()
    assert [len(c) for c in out] == [2] * (len(TEXTS) * G)  # two tokens, then end-of-turn (stripped)
    assert len(calls) == 3 + (1 if dedup else 0) < NEW


def test_the_head_never_runs_per_row_in_bf16(tiny):
    """HF hands the output head a [rows, 1, hidden] slice at prefill; when the head is frozen (LoRA)
    and the slice is not copied (bf16 weights, no autocast cast), torch's matmul cannot fold it and
    runs a bmm over one copy of the head's weight per row (Gemma 3: 16.7 GB at 50 rows). The head
    must see one matmul: no bmm whose output spans the vocabulary."""
    import copy

    from torch.utils._python_dispatch import TorchDispatchMode

    tok, eot, model = tiny
    model = copy.deepcopy(model).to(torch.bfloat16).requires_grad_(False)  # frozen, as under LoRA
    vocab = model.get_output_embeddings().weight.shape[0]
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.bmm.default and out.shape[-1] == vocab:
                seen.append(tuple(args[1].shape))
            return out

    with Ops():
        generate(model, tok, _convs(), 3, eot)
    assert seen == [], f"the head ran as a bmm over per-row copies of its weight: {seen}"
