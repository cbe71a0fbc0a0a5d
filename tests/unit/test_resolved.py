"""The resolved run (workbench/resolve/resolved.py) is the one place run-wide decisions are made, and the
code is held to that: grep-level checks over workbench/, the import layers the README's Layout
names, a read-only config after validation, and the defects the resolved run replaced.

    OMP_NUM_THREADS=1 python -m pytest -q tests/unit/test_resolved.py
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from tests.conftest import ROOT, compose, train
from workbench.core.errors import UserError
from workbench.resolve.derive import derive
from workbench.resolve.resolved import resolve_run
from workbench.train.layout import Layout

PKG = ROOT / "workbench"
SOURCES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}
# validate.py checks the fields, rules.py refuses combinations before a run is resolved (the rules
# of one backend or method read them through config/rule.py), and derive.py derives from them:
# only these read the raw fields.
READERS = {"workbench/resolve/validate.py", "workbench/resolve/rules.py", "workbench/resolve/derive.py",
           "workbench/config/rule.py"}

def test_only_the_resolved_run_reads_peft_kind_and_precision_name():
    pattern = re.compile(r"\bcfg\.(peft\.kind|precision\.name)\b|\bc\.(peft\.kind|precision\.name)\b")
    found = [f"{p}:{i}" for p, text in SOURCES.items() if p not in READERS
             for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert found == []


def test_only_the_resolved_run_builds_a_precision_policy():
    calls = [f"{p}:{i}" for p, text in SOURCES.items() if p not in ("workbench/resolve/derive.py",
                                                                     "workbench/compute/precision.py")
             for i, line in enumerate(text.splitlines(), 1) if re.search(r"\bpolicy\(", line)]
    assert calls == []


def test_the_runner_never_probes_methods_or_backends():
    # where Method and Backend objects (and their modules) are held
    holders = {"workbench/run/runner.py", "workbench/guard/faults.py", "workbench/run/preflight.py",
               "workbench/export/write.py", "workbench/launch/torchrun.py"}
    holders |= {p for p in SOURCES if p.startswith(("workbench/methods/", "workbench/backends/"))}
    probe = re.compile(r"\b(hasattr|getattr)\((self\.)?(ctx\.)?(backend|method|backend_module|module)\b")
    found = [f"{p}:{i}: {line.strip()}" for p, text in SOURCES.items() if p in holders
             for i, line in enumerate(text.splitlines(), 1) if probe.search(line)]
    assert found == []


def test_the_config_is_read_only_after_validation(tmp_path):
    cfg = compose([], tmp_path)
    assert OmegaConf.is_readonly(cfg)
    with pytest.raises(ReadonlyConfigError):
        cfg.peft.quant_storage = "bfloat16"
    # and a run goes through on it: nothing downstream writes to it
    train(["method=dpo", "train.max_steps=1", "eval=none", "train.export=false"], tmp_path / "dpo")


def test_facts(tmp_path):
    lora = derive(compose(["method=dpo", "precision=bf16-mixed"], tmp_path))
    assert (lora.reference, lora.peft.adapter, lora.load_dtype) == ("adapter", True, torch.bfloat16)
    assert lora.precision.compute_dtype == torch.bfloat16 and lora.export_dtype == torch.bfloat16
    full = derive(compose(["method=dpo", "peft=none", "precision=fp32"], tmp_path))
    assert (full.reference, full.load_dtype, full.export_dtype) == ("copy", torch.float32, torch.float32)
    assert derive(compose(["method=grpo"], tmp_path)).reference == "none"  # beta=0: no KL, no reference
    assert derive(compose(["method=grpo", "method.beta=0.04"], tmp_path)).reference == "adapter"
    # QLoRA under sharding stores its 4-bit weights in the policy's frozen dtype; the config keeps uint8
    q = compose(["peft=qlora", "backend=fsdp2", "precision=bf16-mixed"], tmp_path)
    assert (derive(q).peft.quant_storage, q.peft.quant_storage) == ("bfloat16", "uint8")
    assert derive(compose(["peft=qlora"], tmp_path)).peft.quant_storage == "uint8"
    run = derive(compose(["train.micro_batch_size=4", "train.grad_accum=3", "hardware.procs=2"], tmp_path))
    assert (run.layout.world, run.layout.dp, run.batch.size) == (2, 2, 24)


@pytest.mark.parametrize("amx,avx512_bf16,want", [(False, False, "fp32"), (True, False, "bf16-mixed"),
                                                  (False, True, "bf16-mixed")])
def test_precision_auto_follows_the_cpus_bf16_arithmetic(tmp_path, monkeypatch, amx, avx512_bf16, want):
    """precision=auto (the default): bf16-mixed on CPUs that multiply bf16 in hardware, fp32 on
    those that would emulate it; the choice and its reason are in the resolved summary (the
    manifest's `resolved`). A GPU profile planned from here resolves to bf16-mixed."""
    monkeypatch.delenv("WORKBENCH_CPU_BF16", raising=False)  # the detection itself, not its override
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cfg = compose(["model=tiny"], tmp_path, base=[])  # the shipped defaults (tests pin fp32 elsewhere)
    assert cfg.precision.name == "auto"
    run = derive(cfg)
    assert run.precision.name == want and run.summary()["precision"] == want
    assert ("no bf16" in run.summary()["precision_auto"]) == (want == "fp32")
    assert derive(compose(["precision=fp32"], tmp_path)).summary().get("precision_auto") is None
    assert derive(compose(["model=tiny", "hardware=h100-80gb"], tmp_path, base=[])).precision.name == "bf16-mixed"


@pytest.mark.parametrize("isa,want", [("AVX2", ""), ("AVX512_CORE", ""), ("AVX512_CORE_BF16", "AMX"),
                                      ("ALL", "AMX")])
def test_onednn_capped_below_bf16_resolves_auto_to_fp32(monkeypatch, isa, want):
    """ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16 (how docs/testing.md emulates an AVX2-only CPU)
    leaves oneDNN without bf16 instructions on any CPU: `auto` then picks fp32, as it would there."""
    from workbench.compute import precision

    monkeypatch.delenv("WORKBENCH_CPU_BF16", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert precision.cpu_bf16_units() == want


@pytest.mark.parametrize("forced,want", [("0", "fp32"), ("1", "bf16-mixed")])
def test_precision_auto_override_and_the_start_line(tmp_path, monkeypatch, forced, want):
    """WORKBENCH_CPU_BF16 makes one machine resolve `auto` either way (the suite runs under both);
    the start line names the choice and why, and a set precision says it was set."""
    from workbench.compute import precision

    monkeypatch.setenv("WORKBENCH_CPU_BF16", forced)
    summary = derive(compose(["model=tiny"], tmp_path, base=[])).summary()
    line = precision.describe(summary["precision"], summary.get("precision_auto"))
    assert line.startswith(f"precision: {want} (auto: ") and ("WORKBENCH_CPU_BF16=1" in line) == (forced == "1")
    summary = derive(compose(["precision=bf16"], tmp_path)).summary()
    assert precision.describe(summary["precision"], summary.get("precision_auto")) == "precision: bf16 (set)"


def test_layout_follows_megatrons_rank_order():
    # tensor fastest, then context, then data, then pipeline (megatron.core's default order)
    ranks = [Layout(rank=r, world=8, tp=2, pp=2) for r in range(8)]
    assert [lay.dp for lay in ranks] == [2] * 8
    assert [lay.dp_rank for lay in ranks] == [0, 0, 1, 1, 0, 0, 1, 1]


def test_resolve_runs_the_rule_table(tmp_path):
    with pytest.raises(UserError, match=r"^\[fp8-needs-gpu\]"):
        resolve_run(compose(["precision=fp8"], tmp_path))


# -- the defects ---------------------------------------------------------------------------------
def test_data_recipe_null_means_the_methods_own(tmp_path):
    """data.recipe used to default to "arith_sft", which doubled as "not set": asking for
    arith_sft by name under DPO silently trained on arith_dpo."""
    assert compose([], tmp_path).data.recipe == "arith_sft"
    assert compose(["method=dpo"], tmp_path).data.recipe == "arith_dpo"
    assert compose(["method=grpo"], tmp_path).data.recipe == "arith_grpo"
    with pytest.raises(UserError, match="not usable here; this method reads format preference"):  # used, refused
        train(["method=dpo", "data.recipe=arith_sft", "train.max_steps=1"], tmp_path / "named")


def test_unknown_optimizer_is_refused_before_weights(tmp_path):
    with pytest.raises(UserError, match=r"'optim.name' must be one of adamw, sgd"):
        compose(["optim.name=adamw8bit"], tmp_path)


def test_vllm_options_are_in_grpos_schema(tmp_path):
    from workbench.methods.grpo import vllm_options

    cfg = compose(["method=grpo", "method.vllm_gpu_memory_utilization=0.5", "method.vllm_sleep_level=2"], tmp_path)
    opts = vllm_options(cfg.method, cfg.data.seq_len)
    assert (opts.gpu_memory_utilization, opts.sleep_level, opts.max_model_len) == (0.5, 2, 2 * cfg.data.seq_len)


@pytest.mark.parametrize("overfit", [0, 1])
def test_grpo_honours_overfit_batches(overfit, tmp_path):
    """GRPO ignored debug.overfit_batches; now it repeats its prompts (completions sampled anew).
    Without dynamic sampling: arith_exact scores the tiny model 0 everywhere, and refilling every
    group would only repeat the generation."""
    train(["method=grpo", f"debug.overfit_batches={overfit}", "train.max_steps=3", "method.log_completions=1",
           "method.dynamic_sampling=false", "eval=none", "train.export=false"], tmp_path)
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert len(prompts) == 3
    assert (len(set(prompts)) == 1) == bool(overfit)
