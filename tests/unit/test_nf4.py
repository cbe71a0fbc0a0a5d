"""NF4 layers compute the same numbers in training and in no-grad evaluation on every CPU
(workbench/peft/lora.py `quantize_nf4`). On a CPU with AVX512-BF16, bitsandbytes' own default
repacks the weight at the first eval forward and computes it in bf16; on another CPU this test
checks the same property, which there holds by default.

    .venv/bin/python -m pytest -q tests/unit/test_nf4.py
"""

from __future__ import annotations

import torch
import transformers as tf
from omegaconf import OmegaConf

from workbench.peft.lora import quantize_nf4


def test_eval_forward_equals_training_forward_and_keeps_the_weight():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    peft_cfg = OmegaConf.create({"double_quant": True, "quant_type": "nf4"})
    model = quantize_nf4(tf.LlamaForCausalLM(cfg), peft_cfg, torch.float32, "uint8")
    layer = model.model.layers[0].mlp.down_proj
    packed = layer.weight.data.clone()
    x = torch.randn(3, 5, 128)
    layer.train()
    trained = layer(x.clone().requires_grad_(True)).detach()
    layer.eval()
    with torch.no_grad():
        evaluated = layer(x)
    assert torch.equal(trained, evaluated)
    assert torch.equal(layer.weight.data, packed)  # not repacked in place
