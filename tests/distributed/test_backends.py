"""FSDP2 and DeepSpeed ZeRO 1/2/3 against backend=single, on CPU with gloo and 2 processes.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_backends.py

Each backend's runs share one torchrun job (tests/distributed/_worker.py), so the processes,
imports and process group are paid for once. The single-process references run in this
process. Tolerances (tests/tolerances.py): losses agree to LOSS_RTOL (only the order of the
gradient reductions differs between 1 and 2 ranks), GRPO's near-zero losses to NEAR_ZERO_ATOL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import train
from tests.helpers import close, ov, worker_job

pytestmark = pytest.mark.distributed


# GRPO whose reward varies on the tiny random model (arith_exact would be 0 everywhere, so would
# the loss); two passes per rollout so the second step's ratios and the reference KL are live.
GRPO = ("method=grpo", 'reward.functions=["tests.rewards:char_length"]', "method.num_iterations=2")


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
        {"name": "f_ac_full", "overrides": ov("backend=fsdp2", "backend.activation_checkpointing=full", "peft=none")},
        {"name": "f_qlora", "overrides": ov("backend=fsdp2", "peft=qlora", "train.export=true",
                                            "train.export_merged=false", steps=2)},
    ]
    return worker_job(runs, tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    runs = matrix(["backend=deepspeed", "backend.stage=3"], "z3") + [
        {"name": "z1_none", "overrides": ov("backend=deepspeed", "backend.stage=1", "peft=none")},
        {"name": "z2_none", "overrides": ov("backend=deepspeed", "backend.stage=2", "peft=none")},
    ] + grpo_runs(["backend=deepspeed", "backend.stage=3"], "z3") + grpo_runs(["backend=deepspeed", "backend.stage=2"], "z2")
    return worker_job(runs, tmp_path_factory.mktemp("zero"))


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


@pytest.mark.parametrize("run", ["f_ac", "f_ac_full"])
def test_fsdp2_activation_checkpointing_changes_nothing(fsdp, run):
    close(fsdp[run]["losses"], fsdp["f_none"]["losses"])


def test_fsdp2_activation_checkpointing_recomputes_the_blocks_it_wraps(fsdp):
    """A checkpointed block runs its forward again in the backward pass (tests/distributed/_worker.py
    counts each decoder block's forwards): `full` every block, `selective` every
    selective_every-th (2: block 0 of the tiny model's 2), none without it."""
    # each checkpoint adds one forward without gradient (its replay probe), recomputed by nothing
    probes = {run: len(fsdp[run]["saves"]) for run in ("f_none", "f_ac", "f_ac_full")}
    plain = fsdp["f_none"]["block_calls"]
    assert len(plain) == 2 and plain[0] == plain[1] > probes["f_none"], plain
    n = plain[0] - probes["f_none"]
    for run in ("f_none", "f_ac", "f_ac_full"):
        assert fsdp[run]["rank1"]["block_calls"] == fsdp[run]["block_calls"], run
    full, sel = probes["f_ac_full"], probes["f_ac"]
    assert fsdp["f_ac_full"]["block_calls"] == [2 * n + full, 2 * n + full]
    assert fsdp["f_ac"]["block_calls"] == [2 * n + sel, n + sel]


def test_fsdp2_async_save_resume_equals_uninterrupted(fsdp):
    assert fsdp["f_res_b"]["resumed_from"].endswith("step-00000002")
    close(fsdp["f_res_a"]["losses"] + fsdp["f_res_b"]["losses"], fsdp["f_none"]["losses"])


def test_fsdp2_async_save_returns_before_the_checkpoint_is_written(fsdp):
    """backend.async_checkpoint=true: `checkpoint.save` returns while the shards are still being
    written (the checkpoint is committed by a later flush), and every checkpoint is on disk by the
    end of the run; a synchronous FSDP2 save (f_none's final one) is on disk when save returns."""
    for run in ("f_res_a", "f_res_b"):
        for rank in (fsdp[run], fsdp[run]["rank1"]):
            saves = rank["saves"]
            assert len(saves) == (2 if run == "f_res_a" else 1), saves  # steps 1 and 2; step 3
            assert not any(s["on_disk_at_return"] for s in saves), saves
            assert all(s["on_disk_after_run"] for s in saves), saves
    sync = fsdp["f_none"]["saves"] + fsdp["f_none"]["rank1"]["saves"]
    assert sync and all(s["on_disk_at_return"] for s in sync), sync


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
    # NF4 values do not depend on the storage dtype (uint8 for single, float32 when sharded), so
    # only the order of the gradient reductions differs, as for the other runs: LOSS_RTOL.
    close(fsdp["f_qlora"]["losses"], single["qlora"])


def parameter_tensors() -> int:
    from tests.conftest import compose
    from workbench.plan.counts import build_full

    return len(list(build_full(compose([]).model).parameters()))  # on the meta device


def test_fsdp2_halves_params_and_optimizer_per_rank(fsdp):
    """Every tensor of the tiny model has an even first dimension, so each of 2 ranks holds exactly
    half of each; AdamW's step counter (a 4-byte scalar per parameter tensor) stays whole on each
    rank (the single-process count leaves scalars out)."""
    full, steps = fsdp["ddp"]["bytes"], 4 * parameter_tensors()
    for rank_bytes in (fsdp["f_none"]["bytes"], fsdp["f_none"]["rank1"]["bytes"]):
        assert 2 * rank_bytes["params"] == full["params"], (rank_bytes, full)
        assert 2 * (rank_bytes["optimizer"] - steps) == full["optimizer"], (rank_bytes, full)


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
    """ZeRO-3 holds half of the parameters and of the optimizer state on each of 2 ranks, ZeRO-1
    and -2 half of the optimizer state and all parameters: exactly, as the flat buffers hold an
    even number of elements."""
    full = fsdp["ddp"]["bytes"]
    for rank in (zero["z3_none"], zero["z3_none"]["rank1"]):
        z3 = rank["bytes"]
        assert 2 * z3["params"] == full["params"] and 2 * z3["optimizer"] == full["optimizer"], (z3, full)
    for stage in (1, 2):
        for rank in (zero[f"z{stage}_none"], zero[f"z{stage}_none"]["rank1"]):
            z = rank["bytes"]
            assert z["params"] == full["params"] and 2 * z["optimizer"] == full["optimizer"], (stage, z, full)
