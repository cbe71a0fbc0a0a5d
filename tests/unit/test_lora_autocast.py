"""Adapter inputs inside autocast (workbench/peft/lora.py `inputs_in_autocast`): skipping peft's
fp32 cast of each LoRA layer's input changes no loss or gradient bit, and removes those copies.

    .venv/bin/python -m pytest -q tests/unit/test_lora_autocast.py
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear

from workbench.peft.lora import inputs_in_autocast


def _model(dropout: float = 0.0, checkpointing: bool = False):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)  # the frozen base in bf16, as bf16-mixed loads it
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear"))
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters in fp32, as workbench.peft.lora.apply leaves them
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.02)  # B starts at zero: give the adapter path a gradient to test
    model.train()
    return model


def _loss_and_grads(model, skip: bool):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    with inputs_in_autocast(model, torch.bfloat16 if skip else None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_skipping_the_round_trip_changes_no_bit(checkpointing):
    model = _model(checkpointing=checkpointing)
    loss_cast, grads_cast = _loss_and_grads(model, skip=False)
    loss_skip, grads_skip = _loss_and_grads(model, skip=True)
    assert torch.equal(loss_cast, loss_skip)
    assert grads_cast.keys() == grads_skip.keys() and len(grads_cast) == 2 * 7 * 2
    for n in grads_cast:
        assert torch.equal(grads_cast[n], grads_skip[n]), n
    assert all(m.cast_input_dtype_enabled for m in model.modules() if isinstance(m, LoraLinear))  # restored


def _copies(model, skip: bool) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _loss_and_grads(model, skip)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_the_round_trip_copies_are_gone():
    """Each of the 14 adapted layers casts its input to fp32 and autocast casts it back: 28 fewer
    dtype copies in the forward (their backward copies come on top)."""
    model = _model()
    assert _copies(model, skip=False) - _copies(model, skip=True) >= 2 * 14


def test_layers_with_dropout_keep_their_cast():
    model = _model(dropout=0.1)
    with inputs_in_autocast(model, torch.bfloat16):
        flags = [m.cast_input_dtype_enabled for m in model.modules() if isinstance(m, LoraLinear)]
    assert len(flags) == 14 and all(flags)


def test_without_autocast_nothing_changes():
    model = _model()
    with inputs_in_autocast(model, None):
        assert all(m.cast_input_dtype_enabled for m in model.modules() if isinstance(m, LoraLinear))
