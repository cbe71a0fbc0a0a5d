"""FSDP2 and DeepSpeed ZeRO 1/2/3 against backend=single, on CPU with gloo and 2 processes.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_backends.py

Each backend's runs share one torchrun job (tests/distributed/_worker.py), so the processes,
imports and process group are paid for once. The single-process references run in this
process. Tolerances (tests/tolerances.py): losses agree to LOSS_RTOL (only the order of the
gradient reductions differs between 1 and 2 ranks), GRPO's near-zero losses to NEAR_ZERO_ATOL.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, train
from tests.tolerances import LOSS_RTOL, NEAR_ZERO_ATOL

pytestmark = pytest.mark.distributed
RTOL = LOSS_RTOL
STEPS = 3


def ov(*items: str, steps: int = STEPS) -> list[str]:
    return [*items, f"train.max_steps={steps}", "++hardware.timeout_minutes=4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
            "PYTHONPATH": str(ROOT)}


def torchrun(runs: list[dict], out: Path, timeout: int = 900) -> dict[str, dict]:
    spec = out / "spec.json"
    out.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"out": str(out), "runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           str(ROOT / "tests/distributed/_worker.py"), str(spec)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for run in runs:
        r0, r1 = (json.loads((out / "results" / f"{run['name']}.rank{r}.json").read_text()) for r in (0, 1))
        assert "error" not in r0, f"{run['name']}: {r0.get('traceback', r0.get('error'))}"
        assert "error" not in r1, f"{run['name']} rank 1: {r1.get('traceback', r1.get('error'))}"
        results[run["name"]] = {**r0, "rank1": r1}
    return results


# GRPO whose reward varies on the tiny random model (arith_exact would be 0 everywhere, so would
# the loss); two passes per rollout so the second step's ratios and the reference KL are live.
GRPO = ("method=grpo", 'reward.functions=["tests.unit.test_rewards:char_length"]', "method.num_iterations=2")


def grpo_runs(backend: list[str], tag: str) -> list[dict]:
    return [{"name": f"{tag}_grpo_none", "overrides": ov(*backend, *GRPO, "peft=none", steps=2)},
            {"name": f"{tag}_grpo_lora", "overrides": ov(*backend, *GRPO, "peft=lora", "method.beta=0.1", steps=2)}]


def matrix(backend: list[str], tag: str, save: tuple[str, ...] = ()) -> list[dict]:
    """The same runs for each sharding backend; the `res` pair is save -> resume (`save`: its options)."""
    return [
        {"name": f"{tag}_none", "overrides": ov(*backend, "peft=none")},
        {"name": f"{tag}_lora", "overrides": ov(*backend, "peft=lora", "train.export=true", "train.export_merged=false")},
        {"name": f"{tag}_res_a", "dir": f"{tag}_res", "overrides": ov(*backend, "peft=none", *save,
                                                                     "train.checkpoint_every=1", steps=2)},
        {"name": f"{tag}_res_b", "dir": f"{tag}_res", "overrides": ov(*backend, "peft=none", *save)},
        {"name": f"{tag}_dpo_lora", "overrides": ov(*backend, "method=dpo", "peft=lora", steps=2)},
        {"name": f"{tag}_dpo_none", "overrides": ov(*backend, "method=dpo", "peft=none", "method.reference=precomputed",
                                                    steps=2)},
    ]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """backend=single, one process, the same global batch (grad_accum=2 of the same micro-batches)."""
    out = tmp_path_factory.mktemp("single")
    runs = {
        "none": ov("peft=none"), "lora": ov("peft=lora"), "qlora": ov("peft=qlora", steps=2),
        "dpo_lora": ov("method=dpo", "peft=lora", steps=2),
        "dpo_none": ov("method=dpo", "peft=none", "method.reference=precomputed", steps=2),
    }
    return {k: train([*o, "train.grad_accum=2"], out / k)["losses"] for k, o in runs.items()}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    runs = matrix(["backend=fsdp2"], "f", save=("backend.async_checkpoint=true",)) + grpo_runs(["backend=fsdp2"], "f") + [
        {"name": "ddp", "overrides": ov("backend=single", "peft=none")},
        {"name": "f_ac", "overrides": ov("backend=fsdp2", "backend.activation_checkpointing=selective", "peft=none")},
        {"name": "f_qlora", "overrides": ov("backend=fsdp2", "peft=qlora", "train.export=true",
                                            "train.export_merged=false", steps=2)},
    ]
    return torchrun(runs, tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    runs = matrix(["backend=deepspeed", "backend.stage=3"], "z3") + [
        {"name": "z1_none", "overrides": ov("backend=deepspeed", "backend.stage=1", "peft=none")},
        {"name": "z2_none", "overrides": ov("backend=deepspeed", "backend.stage=2", "peft=none")},
    ] + grpo_runs(["backend=deepspeed", "backend.stage=3"], "z3") + grpo_runs(["backend=deepspeed", "backend.stage=2"], "z2")
    return torchrun(runs, tmp_path_factory.mktemp("zero"))


def close(a, b, rtol=RTOL):
    assert len(a) == len(b), (a, b)
    assert a == pytest.approx(b, rel=rtol, abs=NEAR_ZERO_ATOL), (a, b)  # abs: on-policy GRPO losses sit near 0


# -- FSDP2 ------------------------------------------------------------------------------------
def test_ddp_is_used_by_single_with_two_ranks(fsdp, single):
    assert fsdp["ddp"]["wrapper"] == "DistributedDataParallel"
    close(fsdp["ddp"]["losses"], single["none"])


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_fsdp2_equals_single(fsdp, single, peft):
    run = fsdp[f"f_{peft}"]
    assert run["wrapper"].startswith("FSDP")
    close(run["losses"], single[peft])
    assert run["rank1"]["losses"] == run["losses"]  # every rank reports the global loss


def test_fsdp2_activation_checkpointing_changes_nothing(fsdp):
    close(fsdp["f_ac"]["losses"], fsdp["f_none"]["losses"])


def test_fsdp2_async_save_resume_equals_uninterrupted(fsdp):
    assert fsdp["f_res_b"]["resumed_from"].endswith("step-00000002")
    close(fsdp["f_res_a"]["losses"] + fsdp["f_res_b"]["losses"], fsdp["f_none"]["losses"])


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_dpo_under_fsdp2(fsdp, single, peft):
    close(fsdp[f"f_dpo_{peft}"]["losses"], single[f"dpo_{peft}"])


def assert_real_adapter(export: dict) -> None:
    """The exported adapter is non-empty and carries trained values (lora_B starts at zero)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(export["adapter"]) / "adapter_model.safetensors"))
    assert tensors and all(t.numel() > 0 for t in tensors.values())
    lora_b = [t for k, t in tensors.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)


@pytest.mark.parametrize("run", ["f_lora", "f_qlora"])
def test_fsdp2_adapter_export_has_real_weights(fsdp, run):
    assert_real_adapter(fsdp[run]["export"])


def test_fsdp2_qlora_equals_single(fsdp, single):
    # NF4 values do not depend on the storage dtype (uint8 for single, float32 when sharded).
    close(fsdp["f_qlora"]["losses"], single["qlora"], rtol=1e-4)


def test_fsdp2_halves_params_and_optimizer_per_rank(fsdp):
    full, shard = fsdp["ddp"]["bytes"], fsdp["f_none"]["bytes"]
    for rank_bytes in (shard, fsdp["f_none"]["rank1"]["bytes"]):
        total = rank_bytes["params"] + rank_bytes["optimizer"]
        assert 0.45 < total / (full["params"] + full["optimizer"]) < 0.55, (rank_bytes, full)


# -- DeepSpeed --------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_equals_single(zero, single, stage):
    close(zero[f"z{stage}_none"]["losses"], single["none"])


def test_zero3_lora_equals_single_and_exports_real_adapter(zero, single):
    close(zero["z3_lora"]["losses"], single["lora"])
    assert_real_adapter(zero["z3_lora"]["export"])


def test_zero3_resume_equals_uninterrupted(zero):
    assert zero["z3_res_b"]["resumed_from"].endswith("step-00000002")
    close(zero["z3_res_a"]["losses"] + zero["z3_res_b"]["losses"], zero["z3_none"]["losses"])


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_dpo_under_zero3(zero, single, peft):
    close(zero[f"z3_dpo_{peft}"]["losses"], single[f"dpo_{peft}"])


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_grpo_generates_through_sharded_weights(zero, fsdp, peft):
    """FSDP2 and ZeRO-3 generate through sharded parameters (ranks step together until all
    stop); ZeRO-2 keeps full weights on each rank. Same seeds, so the same rollouts and losses."""
    full = zero[f"z2_grpo_{peft}"]["losses"]
    assert len(full) == 2 and full[1] != 0.0  # the second pass moves away from the sampling policy
    close(fsdp[f"f_grpo_{peft}"]["losses"], full)
    close(zero[f"z3_grpo_{peft}"]["losses"], full)


def test_zero_partitions_per_rank(zero, fsdp):
    full = fsdp["ddp"]["bytes"]
    z3 = zero["z3_none"]["bytes"]
    assert 0.45 < (z3["params"] + z3["optimizer"]) / (full["params"] + full["optimizer"]) < 0.55, (z3, full)
    z1 = zero["z1_none"]["bytes"]
    assert z1["params"] == full["params"] and 0.45 < z1["optimizer"] / full["optimizer"] < 0.55, (z1, full)
