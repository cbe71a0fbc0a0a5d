"""Preflight: incompatible or impossible configurations are refused before anything heavy, each
with a message naming the fix; the compatibility docs match the rules; dry_run plans 70B here.

    OMP_NUM_THREADS=1 pytest -q tests/unit/test_preflight.py
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import ROOT, compose
from workbench.core.errors import UserError
from workbench.plan.make import DoesNotFit
from workbench.resolve import rules
from workbench.run import preflight

ALL = frozenset({"bitsandbytes", "deepspeed", "megatron", "torchao", "vllm", "unsloth"})
CPU = rules.Env(cuda=False, gpus=0, packages=ALL)
GPU8 = rules.Env(cuda=True, gpus=8, packages=ALL)


@pytest.fixture(scope="module")
def base():
    return compose([])


def variant(base, changes: dict):
    cfg = copy.deepcopy(base)
    OmegaConf.set_readonly(cfg, False)  # a validated config is read-only; a variant is made by hand here
    OmegaConf.set_struct(cfg, False)
    for key, value in changes.items():
        if isinstance(value, dict):
            cfg[key] = OmegaConf.create(value)
        else:
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


CUDA = {"hardware.device": "cuda"}
GRPO = {"method": {"name": "grpo", "num_generations": 4, "engine": "hf"}, "reward": {"functions": [{"name": "x"}]}}

# (rule id, config changes, environment, words the message must contain)
CASES = [
    ("fp8-needs-gpu", {"precision.name": "fp8"}, CPU, "precision=bf16-mixed"),
    ("fp8-needs-fp8-units", {**CUDA, "precision.name": "fp8", "hardware.fp8_tflops": 0.0,
                             "hardware.bf16_tflops": 459.0}, GPU8, "bf16-mixed"),
    ("fp8-needs-torchao", {**CUDA, "precision.name": "fp8", "hardware.fp8_tflops": 1979.0},
     rules.Env(cuda=True, gpus=1), "pip install torchao"),
    ("cuda-not-visible", {**CUDA, "hardware.name": "h100-80gb"}, CPU, "hardware=cpu"),
    ("planning-only-accelerator", {"hardware.device": "tpu", "hardware.name": "tpu-v5p"}, CPU, "dry_run=true"),
    ("procs-exceed-gpus", {**CUDA, "hardware.procs": 16}, GPU8, "hardware.procs<=8"),
    ("multinode-needs-rendezvous", {"hardware.nodes": 2}, CPU, "hardware.rdzv_endpoint"),
    ("unsloth-needs-cuda", {"model.loader": "unsloth"}, CPU, "model.loader=hf"),
    ("unsloth-single-gpu", {**CUDA, "model.loader": "unsloth", "hardware.procs": 2}, GPU8, "backend=fsdp2"),
    ("unsloth-backend", {**CUDA, "model.loader": "unsloth", "backend": {"name": "fsdp2"}}, GPU8, "backend=single"),
    ("qlora-sharded-storage", {"peft.kind": "qlora", "peft.quant_storage": "int8", "backend": {"name": "fsdp2"}},
     CPU, "peft.quant_storage=bfloat16"),
    ("qlora-zero3-checkpointing", {"peft.kind": "qlora", "model.gradient_checkpointing": True,
                                   "backend": {"name": "deepspeed", "stage": 3}}, CPU, "backend=fsdp2"),
    ("deepspeed-fp8", {**CUDA, "precision.name": "fp8", "backend": {"name": "deepspeed", "stage": 3}}, GPU8,
     "precision=bf16-mixed"),
    ("fsdp2-model-checkpointing", {"model.gradient_checkpointing": True, "backend": {"name": "fsdp2"}}, CPU,
     "backend.activation_checkpointing=full"),
    ("qlora-megatron", {"peft.kind": "qlora", "backend": {"name": "megatron"}}, CPU, "peft=lora"),
    ("qlora-fp8", {**CUDA, "peft.kind": "qlora", "precision.name": "fp8"}, GPU8, "precision=bf16-mixed"),
    ("qlora-needs-bitsandbytes", {"peft.kind": "qlora"}, rules.Env(packages=ALL - {"bitsandbytes"}),
     "pip install bitsandbytes"),
    ("dora-megatron", {"peft.kind": "dora", "backend": {"name": "megatron"}}, CPU, "peft=lora"),
    ("lora-megatron-dropout", {"peft.kind": "lora", "peft.dropout": 0.05, "backend": {"name": "megatron"}}, CPU,
     "peft.dropout=0"),
    ("lora-megatron-targets", {"peft.kind": "lora", "peft.target_modules": ["q_proj", "lm_head"],
                               "backend": {"name": "megatron"}}, CPU, "['lm_head']"),
    ("deepspeed-stage", {"backend": {"name": "deepspeed", "stage": 0}}, CPU, "use backend=single"),
    ("param-offload-needs-zero3", {"backend": {"name": "deepspeed", "stage": 2, "offload_param": "cpu"}}, CPU,
     "backend.stage=3"),
    ("nvme-offload-needs-path", {"backend": {"name": "deepspeed", "stage": 3, "offload_optimizer": "nvme",
                                             "nvme_path": ""}}, CPU, "backend.nvme_path"),
    ("fsdp2-offload-on-cpu", {"backend": {"name": "fsdp2", "cpu_offload": True}}, CPU, "cpu_offload=false"),
    ("deepspeed-needs-package", {"backend": {"name": "deepspeed", "stage": 3}},
     rules.Env(packages=ALL - {"deepspeed"}), "pip install -e '.[deepspeed]'"),
    ("megatron-needs-package", {"backend": {"name": "megatron"}}, rules.Env(packages=ALL - {"megatron"}),
     "'.[megatron]'"),
    ("tp-divides-heads", {"backend": {"name": "megatron", "tp": 3}, "hardware.procs": 3}, CPU, "divisor of 2"),
    ("sp-divides-procs", {"backend.sp": 2}, CPU, "multiple of 2"),
    ("sp-method", {"backend.sp": 2, "hardware.procs": 2, "method": {"name": "rm"}}, CPU, "backend.sp=1"),
    ("sp-heads", {"backend.sp": 8, "hardware.procs": 8}, CPU, "backend.sp<="),
    ("sp-attention", {"backend.sp": 2, "hardware.procs": 2, "model.attn_implementation": "eager_paged"}, CPU,
     "model.attn_implementation=sdpa"),
    ("pp-divides-layers", {"backend": {"name": "megatron", "pp": 3}, "hardware.procs": 3}, CPU, "divisor of 2"),
    ("parallel-divides-world", {"backend": {"name": "megatron", "tp": 2}, "hardware.procs": 3}, CPU,
     "must divide the 3 devices"),
    ("ep-needs-experts", {"backend": {"name": "megatron", "ep": 2}, "hardware.procs": 2}, CPU, "backend.ep=1"),
    ("cp-divides-seq", {"backend": {"name": "megatron", "cp": 2}, "hardware.procs": 2, "data.seq_len": 30}, CPU,
     "multiple of 4"),
    ("grpo-needs-reward", {**GRPO, "reward": None}, CPU, "reward=arith_exact"),
    ("grpo-group-size", {**GRPO, "method": {"name": "grpo", "num_generations": 1}}, CPU, "num_generations>=2"),
    ("grpo-whole-groups", {**GRPO, "train.micro_batch_size": 6}, CPU, "multiple of method.num_generations=4"),
    # the data-parallel ranks come from the layout: 4 processes at tp=2 are 2 ranks, so 3 prompts do not divide
    ("grpo-whole-groups", {**GRPO, "method": {"name": "grpo", "num_generations": 4, "prompts_per_step": 3},
                           "backend": {"name": "megatron", "tp": 2}, "hardware.procs": 4, "peft.kind": "none"}, CPU,
     "multiple of the 2 data-parallel rank(s)"),
    ("grpo-deepspeed-accum", {**GRPO, "method": {"name": "grpo", "num_generations": 2, "prompts_per_step": 4},
                              "train.micro_batch_size": 4, "train.grad_accum": 1,
                              "backend": {"name": "deepspeed", "stage": 2}}, CPU, "train.grad_accum=2"),
    ("kto-kl-needs-pairs", {"method": {"name": "kto"}, "train.micro_batch_size": 1}, CPU,
     "method.loss_type=apo_zero_unpaired"),
    ("vllm-needs-cuda", {**GRPO, "method": {"name": "grpo", "num_generations": 4, "engine": "vllm"}}, CPU,
     "method.engine=hf"),
    ("dpo-adapter-ref-needs-peft", {"method": {"name": "dpo", "reference": "adapter"}, "peft.kind": "none"}, CPU,
     "method.reference=copy"),
    ("seq-exceeds-context", {"data.seq_len": 4096}, CPU, "data.seq_len<=2048"),
    ("flash-attn-on-cpu", {"model.attn_implementation": "flash_attention_2"}, CPU,
     "model.attn_implementation=sdpa"),
    ("liger-on-cpu", {"kernels": "liger"}, CPU, "kernels=none"),
    ("gguf-types", {"train.export": True, "export.gguf": ["q4_k_m"]}, CPU, "llama-quantize"),
    ("gguf-family", {"train.export": True, "export.gguf": ["f16"], "model.arch.family": "mixtral"}, CPU,
     "convert the merged folder"),
    ("push-needs-token", {"train.export": True, "export.push_to_hub": "me/x"}, CPU, "$HF_TOKEN"),
    # moved here from the backends, loaders and engines that used to check them again
    ("fp8-needs-sm89", {**CUDA, "precision.name": "fp8", "hardware.fp8_tflops": 1979.0},
     rules.Env(cuda=True, gpus=1, packages=ALL, capability=(8, 0)), "compute capability >= 8.9"),
    ("unsloth-kernels", {**CUDA, "model.loader": "unsloth", "kernels": "liger"}, GPU8, "kernels=none"),
    ("unsloth-dora", {**CUDA, "model.loader": "unsloth", "peft.kind": "dora"}, GPU8, "model.loader=hf"),
    ("unsloth-needs-package", {**CUDA, "model.loader": "unsloth"}, rules.Env(cuda=True, gpus=1, packages=ALL - {"unsloth"}),
     "'.[unsloth]'"),
    ("deepspeed-offload-choice", {"backend": {"name": "deepspeed", "stage": 3, "offload_optimizer": "disk"}}, CPU,
     "none, cpu or nvme"),
    ("fsdp2-checkpointing-choice", {"backend": {"name": "fsdp2", "activation_checkpointing": "some"}}, CPU,
     "none, full or selective"),
    ("fsdp2-reduce-dtype", {"backend": {"name": "fsdp2", "reduce_dtype": "int8"}}, CPU, "float32, bfloat16"),
    ("fsdp2-sync-choice", {"backend": {"name": "fsdp2", "sync_each_micro_batch": "sometimes"}}, CPU,
     "auto, true or false"),
    ("sharded-vllm", {**CUDA, **GRPO, "method": {"name": "grpo", "num_generations": 4, "engine": "vllm"},
                      "backend": {"name": "fsdp2"}}, GPU8, "method.engine=hf"),
    ("sharded-copied-reference", {"method": {"name": "dpo", "reference": "auto"}, "peft.kind": "none",
                                  "backend": {"name": "fsdp2"}}, CPU, "method.reference=precomputed"),
    ("sharded-copied-reference", {"method": {"name": "kto", "reference": "auto"}, "peft.kind": "none",
                                  "backend": {"name": "fsdp2"}}, CPU, "use peft=lora"),
    ("unsloth-scalar-head", {"method": {"name": "rm"}, "model.loader": "unsloth"}, CPU, "model.loader=hf"),
    ("distill-needs-teacher", {"method": {"name": "distill"}}, CPU, "needs method.teacher: set it"),
    ("distill-packing", {"method": {"name": "distill", "teacher": "tiny"}, "data.packing": True}, CPU,
     "data.packing=false"),
    ("megatron-fp8", {"backend": {"name": "megatron", "fp8": "hybrid"}}, CPU, "backend.fp8=null"),
    ("megatron-distopt-fp16", {"backend": {"name": "megatron", "distributed_optimizer": True},
                               "precision.name": "fp16"}, CPU, "precision=bf16-mixed"),
    ("megatron-distopt-adam", {"backend": {"name": "megatron", "distributed_optimizer": True},
                               "optim.name": "sgd"}, CPU, "optim.name=adamw"),
    ("megatron-moe-tp-needs-sp", {"backend": {"name": "megatron", "tp": 2}, "hardware.procs": 2, "peft.kind": "none",
                                  "model.arch.family": "mixtral", "model.arch.experts": 4,
                                  "model.arch.experts_per_token": 2}, CPU, "backend.tp=1 with backend.ep"),
    ("megatron-pp-one-forward", {"method": {"name": "kto"}, "backend": {"name": "megatron", "pp": 2},
                                 "hardware.procs": 2, "peft.kind": "none"}, CPU, "apo_zero_unpaired"),
    ("megatron-pp-one-forward", {"method": {"name": "dpo"}, "backend": {"name": "megatron", "pp": 2},
                                 "hardware.procs": 2, "peft.kind": "lora"}, CPU, "adapter-free model"),
    ("megatron-sequence-parallel", {"backend": {"name": "megatron", "sequence_parallel": True}}, CPU,
     "backend.sequence_parallel=false"),
    ("megatron-cp-needs-gpu", {"backend": {"name": "megatron", "cp": 2}, "hardware.procs": 2}, CPU,
     "attention on a GPU"),
    ("megatron-recompute-choice", {"backend": {"name": "megatron", "recompute": "most"}}, CPU, "none, selective, full"),
    ("vllm-needs-package", {**CUDA, **GRPO, "method": {"name": "grpo", "num_generations": 4, "engine": "vllm"}},
     rules.Env(cuda=True, gpus=1, packages=ALL - {"vllm"}), "'.[vllm]'"),
    ("vllm-dora", {**CUDA, **GRPO, "method": {"name": "grpo", "num_generations": 4, "engine": "vllm"},
                   "peft.kind": "dora"}, GPU8, "peft=dora"),
    ("attention-choice", {"model.attn_implementation": "flash"}, CPU, "sdpa"),
    ("flash-attn-needs-package", {**CUDA, "model.attn_implementation": "flash_attention_2"},
     rules.Env(cuda=True, gpus=1, packages=ALL), "pip install flash-attn"),
    ("kernels-choice", {"kernels": "triton-magic"}, CPU, "none, liger"),
    ("liger-needs-package", {**CUDA, "kernels": "liger"}, rules.Env(cuda=True, gpus=1, packages=ALL), "'.[liger]'"),
    # multi-turn episodes (env=) and rollouts one step ahead
    ("env-needs-grpo", {"env": {"name": "calc", "max_turns": 3}}, CPU, "use method=grpo"),
    ("env-rewards-need-env", {**GRPO, "reward": {"functions": [{"name": "final_answer"}]}}, CPU, "env=calc"),
    ("async-rollouts-one-process", {**GRPO, "method": {**GRPO["method"], "async_rollouts": True},
                                    "backend": {"name": "fsdp2"}, "hardware.procs": 2}, CPU,
     "method.async_rollouts=false"),
    ("async-rollouts-vllm", {**CUDA, **GRPO, "method": {**GRPO["method"], "async_rollouts": True, "engine": "vllm"}},
     GPU8, "method.async_rollouts=false"),
    ("async-rollouts-kl-in-reward", {**GRPO, "method": {**GRPO["method"], "async_rollouts": True, "beta": 0.1,
                                                        "kl_in_reward": True}}, CPU, "method.async_rollouts=false"),
    # workbench/backends/megatron.py's own rules (its SPEC.rules)
    ("megatron-family", {"backend": {"name": "megatron"}, "peft.kind": "none", "model.arch.family": "gemma2"}, CPU,
     "backend=fsdp2"),
]


@pytest.mark.parametrize("rule_id,changes,env,fix", CASES, ids=[c[0] for c in CASES])
def test_preflight_refuses_with_the_fix(base, rule_id, changes, env, fix):
    cfg = variant(base, changes)
    with pytest.raises(UserError) as err:
        preflight.check(cfg, env=env)
    msg = str(err.value)
    assert msg.startswith(f"[{rule_id}]"), msg
    assert fix in msg, msg
    assert "\n" not in msg


def test_every_rule_is_exercised_and_the_base_config_passes(base):
    assert {c[0] for c in CASES} == {r.id for r in rules.RULES}
    assert len(CASES) >= 20
    assert rules.violations(base, CPU) == []


def test_a_run_that_cannot_fit_is_refused_with_the_plan(base):
    cfg = variant(base, {"model": OmegaConf.merge(base.model, {"name": "llama3-70b", "arch": {
        "layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "head_dim": 128, "intermediate": 28672,
        "vocab": 128256, "max_position": 131072, "tie_embeddings": False}})})
    with pytest.raises(UserError) as err:
        preflight.check(cfg, env=CPU)
    msg = str(err.value)
    assert "GiB per device" in msg and "hardware=cpu" in msg and "dry_run=true" in msg


def test_dry_run_plans_past_machine_rules_and_renders_a_sample(base):
    cfg = variant(base, {**CUDA, "hardware.name": "h100-80gb", "hardware.memory_gb": 80.0, "dry_run": True})
    facts = preflight.check(cfg, env=CPU)
    assert any("cuda-not-visible" in w for w in facts["warnings"])
    assert facts["plan"]["here"]["fits"]
    assert facts["sample"]["trained"] > 0 and facts["sample"]["tokens"] > facts["sample"]["trained"]
    assert facts["n_params"] == facts["plan"]["params"]["total"]


@pytest.mark.parametrize("overrides,message", [
    (["method=dpo", "method.beta=0"], "method.beta must be > 0"),
    (["method=grpo", "method.advantage=loo", "method.scale_rewards=none"], "method.advantage='loo' is not one of"),
])
def test_a_dry_run_refuses_a_bad_method_option_before_any_weights(monkeypatch, overrides, message):
    """A method's own option checks (its SPEC.check) run when the run resolves, so preflight and
    dry_run=true refuse what the run would, before a model or its weights are read."""
    import workbench.models.build as build
    import workbench.models.load as load

    def no_weights(*a, **k):
        raise AssertionError("a model was loaded before the option error")

    monkeypatch.setattr(build, "load_model", no_weights)
    monkeypatch.setattr(load, "load_model", no_weights)
    with pytest.raises(UserError, match=re.escape(message)):
        preflight.check(compose([*overrides, "dry_run=true"]), env=CPU)


def test_a_remote_launcher_skips_this_machines_rules(base):
    cfg = variant(base, {**CUDA, "hardware.name": "h100-80gb", "launcher": {"name": "modal"}})
    assert rules.check(cfg, CPU) and "cuda-not-visible" in rules.check(cfg, CPU)[0]


def test_compatibility_docs_are_generated_from_the_rules():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_compat_docs", ROOT / "scripts" / "gen_compat_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "compatibility.md").read_text() == module.render(), \
        "docs/compatibility.md is stale: run python scripts/gen_compat_docs.py"


def test_70b_dpo_refuses_then_dry_run_plans(tmp_path, capsys):
    from workbench.cli import run_job

    ov = ["method=dpo", "model=70b", f"output_dir={tmp_path / 'run'}"]
    with pytest.raises(UserError) as err:
        run_job(compose(ov, validate=False, base=[]))
    msg = str(err.value)
    assert msg.startswith("model=llama3-70b method=dpo") and "GiB per device" in msg and "hardware=" in msg
    assert not (tmp_path / "run").exists()  # refused before the run directory or any weights
    capsys.readouterr()
    # the dry run prints the whole plan, then ends with status 4: it does not fit (workbench/plan/make.py)
    with pytest.raises(DoesNotFit) as stop:
        run_job(compose(ov + ["dry_run=true", "plan.json=true"], validate=False, base=[]))
    assert stop.value.exit_code == 4 and "it fits on" in str(stop.value)  # nothing fits this CPU
    out = capsys.readouterr().out
    facts = json.loads(out[out.index("{"):])
    plan = facts["plan"]
    assert facts["fits"] is False and facts["exit_status"] == 4
    assert plan["params"]["total"] == 70_553_706_496 and not plan["here"]["fits"]
    assert any(r["fits"] or r["devices_needed"] for r in plan["profiles"])
    assert facts["model_source"] == "not found here"  # planned without weights


@pytest.mark.slow
def test_cli_70b_dpo_refuses_then_plans_without_download(tmp_path):
    import resource

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "WORKBENCH_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "workbench", "method=dpo", "model=70b", f"output_dir={tmp_path / 'run'}"]
    t, cpu0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    wall, cpu1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "error: model=llama3-70b method=dpo" in refused.stderr and "GiB per device" in refused.stderr
    planned = subprocess.run(cmd + ["dry_run=true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert planned.returncode == 4, planned.stderr[-2000:]  # the plan, and it does not fit here
    assert "where it runs" in planned.stdout and "it fits on 8" in " ".join(planned.stdout.split())
    assert not any(Path(tmp_path / "hf").rglob("*.safetensors"))  # nothing was downloaded
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    print(f"70B refusal: {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert cpu < 30


def test_keep_best_is_checked_against_the_metrics_the_tasks_report():
    """evals/hooks.py says what each task reports; keep_best checks the name against it, with the
    closest one; a task whose metrics are known only when it runs (a hook, lm_eval) takes any."""
    from workbench.checkpoints import keep_best
    from workbench.evals import hooks

    tasks = ["loss", "arith_add2", "mypkg.evals:exact", "lm_eval:hellaswag"]
    reported = hooks.metrics(tasks)
    assert reported["loss"][:2] == ("loss", "perplexity") and "seconds" in reported["arith_add2"]
    assert reported["exact"] is None and reported["lm_eval"] is None
    for ok in ("loss/loss", "eval/arith_add2/accuracy", "exact/anything", "lm_eval/hellaswag/acc"):
        keep_best.check_metric(ok, tasks, reported)
    with pytest.raises(UserError, match=r"train.keep_best='loss/los'.*did you mean loss/loss\? they report: loss/loss, "
                                        r".*exact/<metric>"):
        keep_best.check_metric("loss/los", tasks, reported)
    with pytest.raises(UserError, match="eval.tasks=\\[\\] evaluates nothing"):
        keep_best.check_metric("loss/loss", [], {})
    reward = hooks.metrics(["reward"], compose(["method=grpo", "reward=arith_format"]))["reward"]
    assert {"mean", "n", "seconds"} < set(reward) and len(reward) > 3  # one mean per reward function
