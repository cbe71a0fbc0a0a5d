"""LoRA on Megatron layers trains like LoRA on backend=single: losses and the trained adapters at
tp=2, pp=2, tp=2 x pp=2 and on a tiny Mixtral with ep=2; the exported adapter and merged model
pass the parity gate (CPU, gloo).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_megatron_lora.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_megatron_lora.py

Each Megatron case is a run of the real runner under torchrun (tests/helpers.py worker_job; the
default tier's tp=2 run shares its job with tests/distributed/test_megatron_methods.py's,
tests/distributed/conftest.py); its reference is the same run with backend=single in this
process, at the same global batch. Plain SGD (tests/distributed/megatron_cases.py LORA), so a
weight's error stays proportional to its gradients' (tests/helpers.py sgd_weight_bound); the
adapters' B start at zero, so from the first step on a wrong shard, scale or reduction moves
them by their own size.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import compose
from tests.distributed.megatron_cases import LORA
from tests.helpers import sgd_weight_bound, worker_job
from tests.tolerances import LOSS_RTOL

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed

# A 4-layer tiny Llama with 4 KV heads: tp=2 x pp=2 splits heads and layers.
WIDE = ["model.arch.layers=4", "model.arch.kv_heads=4"]
MIXTRAL = ["model.arch.family=mixtral", "model.arch.experts=4", "model.arch.experts_per_token=2",
           "model.arch.tie_embeddings=false"]


def single(tmp_path: Path, overrides: list[str]):
    """The reference run in this process: (results, trainable tensors by name, run dir)."""
    from workbench.run.runner import Runner

    out = tmp_path / "single"
    runner = Runner(compose([*overrides, "backend=single"], out))
    res = runner.train()
    weights = {k: v.detach().clone() for k, v in runner.model.named_parameters() if v.requires_grad}
    return res, weights, out


def assert_trains_like(got: dict, ref, trainable: Path, label: str) -> None:
    from safetensors.torch import load_file

    res, ref_weights, ref_dir = ref
    assert len(got["losses"]) == len(res["losses"]) == 3
    # TP/PP split the matmuls and sums: LOSS_RTOL (tests/tolerances.py)
    assert got["losses"] == pytest.approx(res["losses"], rel=LOSS_RTOL), (label, got["losses"], res["losses"])
    assert got["losses"][-1] < got["losses"][0], label  # it learns
    weights = load_file(trainable)
    assert set(weights) == set(ref_weights), label  # the same adapters, under PEFT's names
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    moved = max(float(v.abs().max()) for k, v in ref_weights.items() if "lora_B" in k)
    bound = sgd_weight_bound(ref_dir, ref_weights)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], res["losses"]))
    print(f"{label}: losses rel diff {loss_diff:.2e} (rtol {LOSS_RTOL:.0e}), adapters max abs diff {worst:.2e} "
          f"(bound {bound:.2e}, largest B {moved:.2e})")
    assert moved > 1e3 * bound, (label, moved, bound)  # B left zero: the comparison below would say nothing
    assert worst < bound, (label, worst, bound)


def test_tp2_trains_like_single_and_exports(megatron_default, tmp_path):
    got, out = megatron_default
    got = got["lora-tp2"]
    assert_trains_like(got, single(tmp_path, LORA), out / "lora-tp2" / "trainable.safetensors", "tp2")
    assert got["bytes"]["optimizer"] == 0  # plain SGD keeps no state
    # The export: the adapter and the merged model, with the base rebuilt from its source on rank 0
    # (the HF copy kept only the adapters), pass the parity gate against the trained model.
    exported = got["export"]
    assert exported["failed"] == [] and exported["parity"]["merged"]["passed"], exported
    assert (out / "lora-tp2" / "export" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.slow  # four layouts in two jobs, ~3.5 min on 2 cores
def test_pp2_tp2pp2_and_mixtral_ep2(tmp_path):
    refs = {"pp2": single(tmp_path / "dense", LORA), "tp2pp2": single(tmp_path / "wide", LORA + WIDE),
            "ep2": single(tmp_path / "moe", LORA + MIXTRAL),
            "ep2-full": single(tmp_path / "moe-full", LORA + MIXTRAL + ["peft=none", "optim.lr=0.1"])}
    two = [{"name": "pp2", "overrides": [*LORA, "backend=megatron", "backend.pp=2"], "save_trainable": True},
           {"name": "ep2", "overrides": [*LORA, *MIXTRAL, "backend=megatron", "backend.ep=2",
                                         "train.grad_accum=1"], "save_trainable": True},
           # experts' own gradients (full fine-tuning) are summed over expert-data-parallel ranks only
           {"name": "ep2-full", "overrides": [*LORA, *MIXTRAL, "peft=none", "optim.lr=0.1", "backend=megatron",
                                              "backend.ep=2", "train.grad_accum=1"], "save_trainable": True}]
    got = worker_job(two, tmp_path / "meg2", timeout=1500)
    four = worker_job([{"name": "tp2pp2", "overrides": [*LORA, *WIDE, "backend=megatron", "backend.tp=2",
                                                        "backend.pp=2"], "save_trainable": True}],
                      tmp_path / "meg4", timeout=1500, procs=4)
    for name, res in {**got, **four}.items():
        where = tmp_path / ("meg4" if name == "tp2pp2" else "meg2") / name / "trainable.safetensors"
        if name == "ep2-full":
            _assert_full_like(res, refs[name], where)
        else:
            assert_trains_like(res, refs[name], where, name)


def _assert_full_like(got: dict, ref, trainable: Path) -> None:
    from safetensors.torch import load_file

    res, ref_weights, ref_dir = ref
    assert got["losses"] == pytest.approx(res["losses"], rel=LOSS_RTOL), (got["losses"], res["losses"])
    weights = load_file(trainable)
    experts = [k for k in weights if ".experts." in k]
    assert experts, sorted(weights)[:5]
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in experts)
    bound = sgd_weight_bound(ref_dir, ref_weights)
    print(f"ep2 full fine-tune: losses {got['losses']} vs {res['losses']}, experts max abs diff {worst:.2e} "
          f"(bound {bound:.2e})")
    assert worst < bound, (worst, bound)
