"""GPU-only options refuse clearly on CPU; optional-package guards work; the vLLM engine's
weight sync and its stale-weight check work (against an HF-backed stand-in); gpu_check --dry.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_gpu_guards.py
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, compose
from tests.tolerances import LOSS_RTOL, VLLM_PROBE_DELTA, scale_atol
from workbench.core.errors import UserError
from workbench.models import unsloth_loader
from workbench.models.load import attention_for, load_model, load_tokenizer
from workbench.resolve import rules
from workbench.resolve.derive import derive
from workbench.rollout import vllm_engine
from workbench.run import preflight


# -- refusals on CPU ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, needle", [
    (["precision=fp8"], "precision=fp8"),
    (["kernels=liger"], "kernels=liger"),
    (["++model.loader=unsloth"], "model.loader=unsloth"),
    (["++model.attn_implementation=flash_attention_2"], "flash_attention"),
    (["method=grpo", "method.engine=vllm"], "method.engine=vllm"),
])
def test_gpu_options_refused_on_cpu(overrides, needle, tmp_path):
    cfg = compose(overrides, tmp_path)
    with pytest.raises(UserError, match="GPU") as err:
        preflight.check(cfg)
    assert needle in str(err.value)


def test_runner_refuses_fp8_before_loading(tmp_path):
    from workbench.run.runner import Runner

    with pytest.raises(UserError, match="fp8"):
        Runner(compose(["precision=fp8"], tmp_path))


def test_attention_choices():
    assert attention_for("sdpa", "cpu") == "sdpa"
    assert attention_for("auto", "cpu") == "sdpa"


# -- import guards: a package blocked in sys.modules is missing to the rules ------------------------
ON_GPU = ["hardware.device=cuda", "hardware.name=h100-80gb"]


def _gpu_env():
    """This machine's packages, as if it had one GPU (the rules read CUDA from the Env)."""
    return rules.Env(cuda=True, gpus=1, packages=rules.current_env().packages)


@pytest.mark.parametrize("blocked, overrides, rule", [
    (["liger_kernel", "liger_kernel.transformers"], ["kernels=liger"], r"\[liger-needs-package\].*'\.\[liger\]'"),
    (["flash_attn"], ["++model.attn_implementation=flash_attention_2"], r"\[flash-attn-needs-package\].*flash-attn"),
    (["vllm"], ["method=grpo", "method.engine=vllm"], r"\[vllm-needs-package\].*'\.\[vllm\]'"),
    (["unsloth"], ["++model.loader=unsloth"], r"\[unsloth-needs-package\].*'\.\[unsloth\]'"),
])
def test_missing_gpu_packages(blocked, overrides, rule, monkeypatch, tmp_path):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    cfg = compose([*ON_GPU, *overrides], tmp_path)
    with pytest.raises(UserError, match=rule):
        rules.check(cfg, _gpu_env())


def test_fp8_missing_package(monkeypatch):
    from workbench.compute import precision

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with pytest.raises(UserError, match="torchao"):
        precision.fp8_backend()


def test_unsloth_refusals(monkeypatch, tmp_path):
    gpus = rules.Env(cuda=True, gpus=8, packages=frozenset({"unsloth"}))
    multi = compose(["++model.loader=unsloth", *ON_GPU, "hardware.procs=2"], tmp_path)
    with pytest.raises(UserError, match="one GPU only"):
        rules.check(multi, gpus)
    dora = compose(["++model.loader=unsloth", *ON_GPU, "peft=dora"], tmp_path)
    with pytest.raises(UserError, match="dora"):
        rules.check(dora, gpus)
    # installed, but the libraries around it break its pins
    versions = {"transformers": "5.18.1", "trl": "1.15.0", "datasets": "5.0.0"}
    monkeypatch.setattr(unsloth_loader, "_version", versions.get)
    with pytest.raises(UserError, match=r"transformers 5\.18\.1 \(needs <=5\.17\.0\), datasets 5\.0\.0 \(needs <5\)"):
        unsloth_loader.check_versions()


def test_unsloth_pin_bounds():
    at_the_pins = {"transformers": "5.17.0", "trl": "1.15.0", "datasets": "4.99.1"}
    assert unsloth_loader.pin_problems(at_the_pins) == []
    assert unsloth_loader.pin_problems({"trl": "1.16.0"}) == ["trl 1.16.0 (needs <=1.15.0)"]
    assert unsloth_loader.pin_problems({"datasets": "5.0.0rc1"}) == ["datasets 5.0.0rc1 (needs <5)"]  # PEP 440
    assert unsloth_loader.pin_problems({"transformers": "5.17.1"}) == ["transformers 5.17.1 (needs <=5.17.0)"]


# -- weight sync and its check --------------------------------------------------------------------
def _lora_model(tmp_path, kind="lora"):
    from workbench.peft import lora

    cfg = compose([f"peft={kind}", "method=grpo"], tmp_path)  # the vLLM engine is GRPO's
    model = lora.apply(load_model(cfg.model), derive(cfg))
    torch.manual_seed(1)
    with torch.no_grad():  # fresh LoRA B is zero; make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return cfg, model


def test_merged_state_dict_equals_peft_merge(tmp_path):
    cfg, model = _lora_model(tmp_path)
    merged = vllm_engine.merged_state_dict(model)
    ref = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert set(merged) == set(ref)
    for name, t in ref.items():
        # W + B A summed in another order than PEFT's merge (tests/tolerances.py)
        torch.testing.assert_close(merged[name].float(), t.float(), rtol=LOSS_RTOL, atol=scale_atol(t.float()),
                                   msg=name)
    # the training model keeps its adapters unmerged
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert not any(getattr(m, "merged", False) for m in model.modules())


class HFStandIn:
    """The engine-side calls of _VLLMAdapter, served by an HF model (what vLLM holds)."""

    def __init__(self, model, apply_loads=True):
        self.model = copy.deepcopy(model)
        self.apply_loads = apply_loads
        self.calls: list[str] = []

    def load_weights(self, items):
        self.calls.append("load")
        if self.apply_loads:
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for n, t in items:
                    params[n].copy_(t)

    def layer_checksum(self):
        return vllm_engine.layer_checksum(list(self.model.named_parameters()))

    def prompt_logprobs(self, ids):
        return vllm_engine.hf_prompt_logprobs(self.model, ids)

    def generate(self, prompts, n, max_new_tokens, temperature, top_p, stop_ids):
        self.calls.append("generate")
        out = []
        for p in prompts:
            seq = self.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                      num_return_sequences=1, pad_token_id=0)[0, len(p):].tolist()
            out.append([seq + [stop_ids[0], 5]] * n)  # anything after end-of-turn must be cut
        return out

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self):
        self.calls.append("wake")


def test_engine_sync_generate_and_stale_check(tmp_path):
    from workbench.data.chat import setup_tokenizer

    cfg, model = _lora_model(tmp_path)
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    plain = load_model(cfg.model)  # the engine starts from the base weights, as vLLM would
    stand_in = HFStandIn(plain)
    engine = vllm_engine.VLLMEngine(cfg, tok, contract, adapter=stand_in)
    first = engine.sync_weights(model)
    assert first["probe_logprob_delta"] <= VLLM_PROBE_DELTA  # the weights arrive in bf16: tests/tolerances.py
    convs = [[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]]
    ids = engine.generate(convs, num_generations=3, max_new_tokens=3, temperature=1.0, top_p=1.0)
    assert len(ids) == 6 and ids[0] == ids[2] and all(contract.end_of_turn_id not in x for x in ids)
    assert stand_in.calls[-2:] == ["generate", "sleep1"] and not engine.awake
    with torch.no_grad():  # an optimizer step changes the adapters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.1)
    second = engine.sync_weights(model)
    assert stand_in.calls[-2:] == ["wake", "load"]
    assert second["checksum"] != first["checksum"]
    # an engine that silently ignores loaded weights is caught at the next sync
    stale = vllm_engine.VLLMEngine(cfg, tok, contract, adapter=HFStandIn(plain, apply_loads=False))
    with pytest.raises(RuntimeError, match="stale weights"):
        stale.sync_weights(model)


def test_engine_serves_episode_turns(tmp_path):
    """Multi-turn episodes through the engine: one completion per running episode per turn, from
    token ids, end-of-turn and what follows it cut; the engine stays awake across the turns."""
    from workbench.data.chat import setup_tokenizer
    from workbench.envs.registry import load
    from workbench.rollout import episodes
    from workbench.rollout.turns import Turns

    cfg, model = _lora_model(tmp_path)
    tok = load_tokenizer(cfg.model)
    contract = setup_tokenizer(tok)
    stand_in = HFStandIn(load_model(cfg.model))
    engine = vllm_engine.VLLMEngine(cfg, tok, contract, adapter=stand_in)
    engine.sync_weights(model)
    ids = engine.generate_ids([[1, 2, 3], [4, 5]], max_new_tokens=3)
    assert len(ids) == 2 and all(len(x) == 3 and contract.end_of_turn_id not in x for x in ids)
    env = load({"name": "calc", "max_turns": 2, "max_new_tokens": 4})
    turns = Turns(tok, contract, env.tools)
    rows = [{"prompt": [{"role": "user", "content": "What is 347 + 589?"}], "answer": "936"}]
    eps = episodes.run(env, turns, rows, lambda p, first: engine.generate_ids(p, 4), repeat=2, max_new_tokens=4)
    assert len(eps) == 2 and all(e.sampled == 4 and e.cut == "max_new_tokens" for e in eps)
    assert "sleep1" not in stand_in.calls[stand_in.calls.index("generate"):]  # awake for the whole loop


# -- the prepared GPU check's CPU wiring ------------------------------------------------------------
def test_gpu_check_dry_runs_every_section(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHON=sys.executable)
    summary = tmp_path / "summary.json"
    # The summary is read from its file: libraries the sections import may print to stdout
    # (DeepSpeed announces its accelerator there), so stdout is not JSON alone.
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry", "--out", str(summary)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(summary.read_text())
    assert out["mode"] == "dry"
    # every section runs on CPU except the Megatron forward, which says why it did not
    for name in ("bf16_full_ft", "lora", "fp8", "rollout", "planner"):
        assert isinstance(out[name], dict), (name, out[name])
    assert out["megatron"].startswith("skipped: --dry"), out["megatron"]
    assert isinstance(out["episodes"], dict) or out["episodes"].startswith("skipped: "), out["episodes"]
    # the planner's predictions for its three configs (--dry: model=tiny, and a smaller stand-in
    # for the 1B model): LoRA needs less than full fine-tuning of the same model, another shape
    # another amount; the measurement needs CUDA's memory counters
    plan = {k: v for k, v in out["planner"].items() if k != "section_seconds"}
    assert set(plan) == {"135m_full_bf16", "135m_lora", "1b_full_bf16"}, plan
    for entry in plan.values():
        assert entry["measured_peak_gb"].startswith("skipped: --dry"), entry
    peak = {k: v["predicted_peak_gb"] for k, v in plan.items()}
    assert 0 < peak["135m_lora"] < peak["135m_full_bf16"] != peak["1b_full_bf16"] > 0, peak
    ft = out["bf16_full_ft"]
    assert ft["smollm2_135m"]["tokens_per_s"] > 0 and ft["llama_1b_random"]["n_params"] != ft["smollm2_135m"]["n_params"]
    assert out["lora"]["lora_hf"]["tokens_per_s"] > 0
    for got, option in ((out["lora"]["lora_liger"], "kernels=liger"),
                        (out["lora"]["qlora_unsloth"], "model.loader=unsloth"),
                        (out["fp8"]["fp8"], "precision=fp8"), (out["rollout"]["vllm"], "method.engine=vllm")):
        assert got.startswith("skipped: ") and option in got and "GPU" in got, got
    assert out["rollout"]["hf_generate"]["completion_tokens"] > 0
