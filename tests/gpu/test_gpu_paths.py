"""The GPU path on a real CUDA device: fp8, Liger kernels, flash attention, unsloth, vLLM sync.

    python -m pytest -q -m gpu tests/gpu/          # skipped without CUDA / the optional package

Each test trains or runs the tiny model for a few steps and compares against the plain path.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import compose, train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = ["hardware.device=cuda", "train.max_steps=4"]


def _final(res) -> float:
    assert all(math.isfinite(x) for x in res["losses"])
    return res["losses"][-1]


def test_bf16_pure_and_mixed_train(tmp_path):
    a = train(CUDA + ["precision=bf16", "peft=none"], tmp_path / "bf16")
    b = train(CUDA + ["precision=bf16-mixed", "peft=none"], tmp_path / "mixed")
    assert abs(_final(a) - _final(b)) < 0.5


def test_fp8_trains_close_to_bf16(tmp_path):
    pytest.importorskip("torchao")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    from workbench.run.runner import Runner

    r = Runner(compose(CUDA + ["precision=fp8", "peft=none"], tmp_path / "fp8"))
    res = r.train()
    assert sum(type(m).__name__ == "Float8Linear" for m in r.model.modules()) > 0
    ref = train(CUDA + ["precision=bf16-mixed", "peft=none"], tmp_path / "bf16")
    assert abs(_final(res) - _final(ref)) < 0.3


def test_liger_matches_plain(tmp_path):
    pytest.importorskip("liger_kernel")
    a = train(CUDA + ["kernels=liger", "peft=lora"], tmp_path / "liger")
    b = train(CUDA + ["peft=lora"], tmp_path / "plain")
    assert abs(_final(a) - _final(b)) < 1e-2


def test_flash_attention_matches_sdpa(tmp_path):
    pytest.importorskip("flash_attn")
    a = train(CUDA + ["++model.attn_implementation=flash_attention_2", "precision=bf16-mixed"], tmp_path / "fa")
    b = train(CUDA + ["precision=bf16-mixed"], tmp_path / "sdpa")
    assert abs(_final(a) - _final(b)) < 5e-2


def test_unsloth_lora_trains(tmp_path):
    pytest.importorskip("unsloth")
    res = train(CUDA + ["++model.loader=unsloth", "peft=lora", "precision=bf16-mixed", "train.max_steps=8",
                        "optim.lr=1e-3"], tmp_path)
    assert _final(res) < res["losses"][0]


def test_vllm_engine_follows_weights(tmp_path):
    pytest.importorskip("vllm")
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_model, load_tokenizer
    from workbench.rollout.vllm_engine import VLLMEngine

    cfg = compose(CUDA + ["peft=none"], tmp_path)
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    model = load_model(cfg.model, dtype=torch.bfloat16, device="cuda")
    engine = VLLMEngine(cfg, tok, contract)
    first = engine.sync_weights(model)
    ids = engine.generate([[{"role": "user", "content": "1+1?"}]] * 2, 4, 8, 1.0, 1.0)
    assert len(ids) == 8
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)
    second = engine.sync_weights(model)  # raises if the engine kept the old weights
    assert second["checksum"] != first["checksum"]
