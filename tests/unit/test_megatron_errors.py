"""backend=megatron's user errors and its LoRA merge, in one process (no process group).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_megatron_errors.py
"""

from __future__ import annotations

import sys

import pytest
import torch
import transformers as tf

from tests.conftest import compose
from tests.tolerances import LOSS_RTOL, scale_atol
from workbench.core.errors import UserError
from workbench.megatron.model import Parallel, check_parallel, family, padded_vocab, rope
from workbench.resolve import rules

SMALL = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)


def test_missing_megatron_core_names_the_package(monkeypatch):
    from workbench.backends import megatron as backend

    for mod in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron.core now raises ImportError
    cfg = compose(["backend=megatron", "peft=none"])
    with pytest.raises(UserError, match=r"megatron-core.*pip install"):
        backend.build(cfg.backend, None)


def test_unmapped_architecture_is_named():
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        family(tf.GPT2Config(architectures=["GPT2LMHeadModel"]))
    for cfg in (tf.LlamaConfig(), tf.Qwen2Config(), tf.Qwen3Config(), tf.MixtralConfig()):
        assert family(cfg) == cfg.model_type


@pytest.mark.parametrize("par, world, field", [
    (Parallel(tp=3), 3, "backend.tp=3 does not divide the model's 4 attention heads"),
    (Parallel(tp=4), 4, "backend.tp=4 does not divide the model's 2 key/value heads"),
    (Parallel(pp=3), 3, "backend.pp=3 does not divide the model's 2 layers"),
    (Parallel(tp=2), 3, "does not divide the 3 processes"),
    (Parallel(ep=2), 2, "backend.ep=2 needs a mixture-of-experts model"),
])
def test_parallel_sizes_that_do_not_divide(par, world, field):
    with pytest.raises(UserError, match=field.replace("(", r"\(").replace("+", r"\+")):
        check_parallel(tf.LlamaConfig(**SMALL), par, world)


def test_expert_parallel_must_divide_experts():
    moe = tf.MixtralConfig(**SMALL, num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(UserError, match="backend.ep=2 does not divide the model's 3 experts"):
        check_parallel(moe, Parallel(ep=2), 2)
    check_parallel(tf.MixtralConfig(**SMALL, num_local_experts=4), Parallel(ep=2), 2)  # fine


def test_config_schema_and_choices():
    cfg = compose(["backend=megatron", "backend.tp=2", "backend.recompute=selective", "peft=none"])
    assert cfg.backend.tp == 2 and cfg.backend.recompute == "selective" and cfg.backend.fp8 is None
    with pytest.raises(UserError, match="backend"):
        compose(["backend=megatron", "+backend.tpp=2"])


CPU_WITH_MEGATRON = rules.Env(packages=frozenset({"megatron"}))


@pytest.mark.parametrize("overrides, message", [
    (["backend.fp8=hybrid"], r"\[megatron-fp8\] backend.fp8 needs Transformer Engine"),
    (["peft=lora", "peft.dropout=0.1"], r"\[lora-megatron-dropout\] peft.dropout=0.1"),
    (["backend.distributed_optimizer=true", "optim.name=sgd"], r"\[megatron-distopt-adam\]"),
    (["backend.recompute=some"], r"\[megatron-recompute-choice\] backend.recompute='some'"),
    (["backend.sequence_parallel=true", "backend.tp=2", "hardware.procs=2"],
     r"\[megatron-sequence-parallel\].*Transformer Engine layer specs"),
])
def test_option_combinations_are_rules(overrides, message):
    with pytest.raises(UserError, match=message):
        rules.check(compose(["backend=megatron", "peft=none", *overrides]), CPU_WITH_MEGATRON)
    rules.check(compose(["backend=megatron", "peft=none"]), CPU_WITH_MEGATRON)


def test_vocab_padding_and_rope_mapping():
    assert padded_vocab(tf.LlamaConfig(vocab_size=251), 2) == 252
    assert rope(tf.LlamaConfig(rope_theta=5e5))["rotary_base"] == 5e5
    l3 = rope(tf.LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert l3["rope_scaling"] and l3["rope_scaling_factor"] == 8.0
    with pytest.raises(UserError, match="rope_type='yarn'"):
        rope(tf.LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 128}))


def test_lora_is_merged_on_the_way_out():
    from peft import LoraConfig, get_peft_model

    from workbench.megatron.bridge import merged_hf_state

    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SMALL)).eval()
    peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_()  # B starts at zero; make the adapter matter
    ids = torch.randint(0, 250, (2, 9))
    with torch.no_grad():
        want = peft(input_ids=ids).logits
    merged = merged_hf_state(peft)
    assert not any("lora" in k or "base_layer" in k for k in merged)
    plain = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SMALL)).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        got = plain(input_ids=ids).logits
    # (W + B A) x against W x + B (A x): the same sums in another order (tests/tolerances.py)
    torch.testing.assert_close(got, want, rtol=LOSS_RTOL, atol=scale_atol(want))
    base_q = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base_q)


def test_preflight_reports_before_weights_load():
    with pytest.raises(UserError, match=r"\[tp-divides-heads\] backend.tp=3 must divide the attention heads"):
        rules.check(compose(["backend=megatron", "backend.tp=3", "hardware.procs=3", "peft=none"]), CPU_WITH_MEGATRON)
    with pytest.raises(UserError, match=r"\[pp-divides-layers\] backend.pp=4 must divide the 2 layers"):
        rules.check(compose(["backend=megatron", "backend.pp=4", "hardware.procs=4", "peft=none"]), CPU_WITH_MEGATRON)
    rules.check(compose(["backend=megatron", "backend.tp=2", "hardware.procs=2", "peft=none"]), CPU_WITH_MEGATRON)
