"""Every export passes the parity gate, and a broken one fails it.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/integration/test_export_parity.py

On the tiny model (fp32, a few steps at a learning rate high enough that the adapters matter):
adapter -> merged for lora, qlora (merged into the dequantised fp32 base) and dora, and merged ->
GGUF f16 and q8_0 (written by workbench/export/gguf.py, read back by transformers' own GGUF loader
and, where llama-cpp-python is installed, run in llama.cpp).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import train
from workbench.export import parity

RUN = ["train.max_steps=3", "optim.lr=1e-2", "train.export=true", "train.resume=never", "export.parity_prompts=6"]


@pytest.mark.parametrize("peft", ["lora", "qlora", "dora"])
def test_merged_export_passes_the_gate(tmp_path, peft):
    res = train([f"peft={peft}", *RUN], tmp_path)
    gate = res["export"]["parity"]["merged"]
    assert gate["passed"] and gate["rounding"] == "exact", gate
    assert gate["greedy_equal"] == gate["prompts"] == 6 and gate["stop_honoured"]
    card = (tmp_path / "export" / "merged" / "README.md").read_text()
    assert f"peft={peft}" in card and "| merged | exact |" in card
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["export"]["parity"]["merged"]["passed"]


@pytest.mark.slow  # two GGUF files read back and run in llama.cpp (nearly 2 min); the default tier
# exports f16 GGUF and checks it in llama.cpp in tests/integration/test_family_export.py
def test_gguf_exports_load_back_and_pass(tmp_path):
    res = train(["peft=lora", *RUN, "export.gguf=[f16,q8_0]"], tmp_path)
    f16, q8 = res["export"]["parity"]["gguf-f16"], res["export"]["parity"]["gguf-q8_0"]
    assert f16["passed"] and f16["rounding"] == "f16" and f16["greedy_equal"] == f16["prompts"], f16
    assert q8["passed"] and q8["rounding"] == "q8_0", q8
    assert q8["bytes"] < f16["bytes"]
    if f16["llama_cpp"]["ran"]:  # llama.cpp's own reading of the file (workbench/export/llama_cpp.py)
        n = f16["prompts"]
        assert f16["llama_cpp"]["tokens_equal"] == n and f16["llama_cpp"]["greedy_equal"] == n, f16["llama_cpp"]
        assert q8["llama_cpp"]["tokens_equal"] == n and q8["llama_cpp"]["passed"], q8["llama_cpp"]
    assert f16["declared_eos"] == q8["declared_eos"]  # the end-of-turn token, not the tokenizer's eos
    from workbench.data.chat import setup_tokenizer
    from workbench.models.load import load_tokenizer, zoo_entry

    assert f16["declared_eos"] == setup_tokenizer(load_tokenizer(zoo_entry("smollm2-135m"))).end_of_turn_id


def test_a_corrupted_export_fails_the_gate(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from workbench.data.chat import setup_tokenizer
    from workbench.evals.hooks import eval_rows
    from workbench.models.load import load_tokenizer, zoo_entry

    train(["peft=lora", *RUN], tmp_path)
    merged = tmp_path / "export" / "merged"
    good = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tensors = load_file(str(merged / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name] * 1.5  # what a mis-scaled merge (alpha/r applied twice) does
    save_file(tensors, str(merged / "model.safetensors"), metadata={"format": "pt"})
    bad = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    tok = load_tokenizer(zoo_entry("smollm2-135m"))
    eot = setup_tokenizer(tok).end_of_turn_id
    convs = [r["prompt"] for r in eval_rows("arith_add2", 6)]
    assert parity.compare(good, good, tok, convs, eot, "exact")["passed"]
    report = parity.compare(good, bad, tok, convs, eot, "exact")
    assert not report["passed"] and report["kl_mean"] > parity.TOLERANCES["exact"][0]
    # a wrong stop token fails too, whatever the logits
    assert not parity.compare(good, good, tok, convs, eot, "exact", declared_eos=eot + 1)["passed"]


def test_a_failed_gate_stops_the_run_unless_allowed(tmp_path, monkeypatch):
    from workbench.core.errors import UserError
    from workbench.export import write as export

    real = export.merged_model

    def dropped_adapter(trained, cfg, dtype):  # the classic bug: the adapters never reach the merge
        model = real(trained, cfg, dtype)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        return model

    monkeypatch.setattr(export, "merged_model", dropped_adapter)
    with pytest.raises(UserError, match="parity gate failed for merged"):
        train(["peft=lora", *RUN], tmp_path / "a")
    assert "merged" in (tmp_path / "a" / "report.md").read_text()
    res = train(["peft=lora", *RUN, "export.allow_mismatch=true"], tmp_path / "b")
    assert res["export"]["failed"] == ["merged"]
