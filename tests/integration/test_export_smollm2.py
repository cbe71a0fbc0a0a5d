"""Export on SmolLM2-135M (slow): the parity gate on the packaged model, and what each GGUF type
scores on the arithmetic eval.

    OMP_NUM_THREADS=2 .venv/bin/python -m pytest -q -m slow tests/integration/test_export_smollm2.py -s

- adapter -> merged for lora, qlora and dora, and merged -> GGUF f16, pass the gate after a short
  run of the embedded default (its precision, bf16-mixed: merged weights are bf16);
- the embedded default trained for 60 steps (fp32 here: CPUs without native bf16 run it 5x
  faster, and fp32 merged weights make merged -> f16 the only rounding), exported to f16 and
  q8_0: the f16 GGUF, loaded back by transformers, gives the same greedy answers as the merged
  model on 20 held-out questions (the gate), and every format's held-out exact match is printed.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import compose, train

SHORT = ["train.max_steps=8", "train.export=true", "train.resume=never", "eval=none", "export.gguf=[f16]"]


@pytest.mark.slow
@pytest.mark.parametrize("peft", ["lora", "qlora", "dora"])
def test_smollm2_merges_and_f16_pass_the_gate(tmp_path, peft):
    res = train([f"peft={peft}", *SHORT], tmp_path, base=[])
    merged, f16 = res["export"]["parity"]["merged"], res["export"]["parity"]["gguf-f16"]
    print(f"\n{peft}: merged {json.dumps(_brief(merged))}\n{peft}: gguf-f16 {json.dumps(_brief(f16))}")
    assert merged["passed"] and merged["rounding"] == "bf16" and merged["stop_honoured"], merged
    assert f16["passed"] and f16["greedy_equal"] == f16["prompts"] == 20, f16


@pytest.mark.slow
def test_trained_default_exports_answer_alike(tmp_path):
    from transformers import AutoModelForCausalLM

    from workbench.data.chat import setup_tokenizer
    from workbench.evals.hooks import exact_match
    from workbench.models.load import load_tokenizer

    res = train(["precision=fp32", "train.max_steps=60", "train.resume=never", "eval.at_end=true",
                 "eval.num_samples=100", "export.gguf=[f16,q8_0]"], tmp_path, base=[])
    gates = res["export"]["parity"]
    assert gates["merged"]["passed"] and gates["merged"]["rounding"] == "exact", gates["merged"]
    assert gates["gguf-f16"]["passed"] and gates["gguf-f16"]["greedy_equal"] == 20, gates["gguf-f16"]
    assert gates["gguf-q8_0"]["passed"], gates["gguf-q8_0"]

    cfg = compose(["eval.num_samples=100"], base=[])
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok, cfg.data.chat_template)
    out = tmp_path / "export"
    models = {"merged (fp32)": lambda: AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)}
    for kind in ("f16", "q8_0"):
        models[f"gguf {kind}"] = lambda kind=kind: AutoModelForCausalLM.from_pretrained(
            out / "gguf", gguf_file=f"model-{kind}.gguf", dtype=torch.float32)
    acc = {}
    for name, load in models.items():
        acc[name] = exact_match(load(), tok, contract, "arith_add2", cfg.eval)["eval/arith_add2/accuracy"]
    sizes = {k: gates[f"gguf-{k}"]["bytes"] for k in ("f16", "q8_0")}
    print(f"\nheld-out exact match (100 questions): {json.dumps(acc)}; GGUF bytes {json.dumps(sizes)}; "
          f"gates {json.dumps({k: _brief(v) for k, v in gates.items()})}")
    # f16 of fp32 weights (KL ~4e-6 per position): an answer changes only on a near-tie of two tokens;
    # the gate saw 20/20 equal, so at most 2 in 100 may flip
    assert abs(acc["gguf f16"] - acc["merged (fp32)"]) <= 0.02


def _brief(gate: dict) -> dict:
    keys = ("rounding", "kl_mean", "kl_max", "logit_max_abs_diff", "greedy_equal", "prompts", "passed")
    return {k: gate.get(k) for k in keys}
