"""SFT on the tiny model: what LoRA trains, exact resume, accumulation, export round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import compose, train
from tests.tolerances import LOSS_RTOL, scale_atol
from workbench.run.runner import Runner


def _params(runner):
    return {n: p.detach().clone() for n, p in runner.model.named_parameters()}


def test_lora_trains_adapters_and_leaves_base_bit_identical(tmp_path):
    runner = Runner(compose(["peft=lora", "train.max_steps=3"], tmp_path))
    runner.build()
    before = _params(runner)
    runner.train()
    after = _params(runner)
    adapters = [n for n in before if "lora_" in n]
    base = [n for n in before if "lora_" not in n]
    assert adapters and base
    assert all(not torch.equal(before[n], after[n]) for n in adapters if "lora_B" in n)
    assert all(torch.equal(before[n], after[n]) for n in base)


def test_four_steps_equal_two_plus_resume_plus_two(tmp_path):
    full = train(["train.max_steps=4", "optim.scheduler=cosine", "optim.warmup_steps=1"], tmp_path / "full")
    common = ["optim.scheduler=cosine", "optim.warmup_steps=1", "train.checkpoint_every=2"]
    # Saving a checkpoint at step 2 must not perturb the run ...
    first = train(common + ["train.max_steps=4"], tmp_path / "split")
    assert first["losses"] == full["losses"]
    # ... and resuming from it (latest pointed back at step 2) replays steps 3-4 exactly.
    (tmp_path / "split" / "checkpoints" / "latest").write_text("step-00000002")
    resumed = train(common + ["train.max_steps=4"], tmp_path / "split")
    assert resumed["resumed_from"].endswith("step-00000002")
    assert resumed["losses"] == full["losses"][2:]


def test_accumulation_1x8_equals_4x2(tmp_path):
    a = train(["train.micro_batch_size=8", "train.grad_accum=1", "train.max_steps=3"], tmp_path / "a")
    b = train(["train.micro_batch_size=2", "train.grad_accum=4", "train.max_steps=3"], tmp_path / "b")
    assert b["losses"] == pytest.approx(a["losses"], rel=LOSS_RTOL)  # another summation order


@pytest.mark.parametrize("peft", ["lora", "none", "qlora"])
def test_export_round_trip_logits_match(tmp_path, peft):
    res = train([f"peft={peft}", "train.export=true", "train.max_steps=2"], tmp_path)
    exp = res["export"]
    # The merged folder, read back from disk, against the trained model (the parity gate). QLoRA
    # is merged into the dequantised NF4 weights it trained against, so it is exact as well.
    gate = exp["parity"]["merged"]
    assert gate["passed"] and gate["rounding"] == "exact" and gate["argmax_agreement"] == 1.0, gate
    # W x + B (A x) against (W + B A) x: the same sums in another order, so the logits differ by
    # their rounding, which scales with the largest logit (tests/tolerances.py scale_atol)
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = merged(input_ids=torch.arange(100, 140).unsqueeze(0)).logits
    assert exp["merged_vs_trained_max_abs_diff"] <= scale_atol(logits), scale_atol(logits)
    gen = json.loads((tmp_path / "export" / "merged" / "generation_config.json").read_text())
    from workbench.models.load import load_tokenizer

    assert gen["eos_token_id"] == load_tokenizer(compose().model).convert_tokens_to_ids("<|im_end|>")
    assert load_file(tmp_path / "export" / "merged" / "model.safetensors")
    if peft == "lora":
        adapter = load_file(tmp_path / "export" / "adapter" / "adapter_model.safetensors")
        assert adapter and all(t.abs().sum() > 0 for k, t in adapter.items() if "lora_A" in k)


def test_run_dir_records_how_the_model_was_made(tmp_path):
    import importlib.metadata

    from omegaconf import OmegaConf

    from tests.helpers import tiny_tokenizer

    cache = tmp_path / "cache"
    res = train(["train.max_steps=1", f"data.cache_dir={cache}"], tmp_path / "run")
    run = tmp_path / "run"
    man = json.loads((run / "manifest.json").read_text())
    for package in ("torch", "transformers"):
        assert man["versions"][package] == importlib.metadata.version(package)
    _, contract = tiny_tokenizer()
    assert man["chat_template"]["end_of_turn"] == "<|im_end|>" == contract.end_of_turn
    assert man["chat_template"]["sha256_16"] == contract.template_hash
    # the fingerprint names the tokenised data this run trained on: the one entry of its cache
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [man["data"]["add2"]["fingerprint"]]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["tokens_per_s"] > 0 and rows[0]["loss"] == res["losses"][0]
    assert OmegaConf.load(run / "config.yaml").train.max_steps == 1
    assert f"{res['losses'][0]:.4f}" in (run / "report.md").read_text()


def test_overfit_one_batch_drives_loss_down(tmp_path):
    res = train(["debug=overfit", "peft=none", "optim.lr=3e-3", "train.max_steps=25"], tmp_path)
    assert res["losses"][-1] < 0.5 * res["losses"][0]
