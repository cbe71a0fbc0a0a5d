"""Every method on backend=megatron at tp=2, and Megatron-Core's distributed optimizer at dp=2, against
backend=single at the same global batch (CPU, gloo).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_megatron_methods.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/distributed/test_megatron_methods.py

What each case exercises on the Megatron side: distill the vocabulary-parallel softmaxes and
divergence (workbench/megatron/vocab.py; the teacher is a full HF model, each rank reads its
columns); rm the scalar head on the last stage; kto the reference as the adapter-free Megatron
model (LoRA) and its KL rows; cpo, simpo and orpo one row per pair with the prompt shared
(per-row RoPE positions and 4-D masks, workbench/megatron/lm.py); dpo reference log-probs
precomputed with the HF copy. Plain SGD, 3 steps: losses to LOSS_RTOL, trained tensors within
tests/helpers.py sgd_weight_bound. The distributed optimizer also runs AdamW (2 steps, losses
only: across summation orders AdamW moves near-zero-gradient weights by up to lr per step, a
negligible change of the loss but not of those weights) and holds half the Adam moments on
each of its 2 ranks.

The default tier's runs share one torchrun job with the LoRA test's (tests/distributed/conftest.py
megatron_default); the slow ones another (tests/helpers.py worker_job).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import compose
from tests.distributed.megatron_cases import ADAMW, FAST, METHODS, TP2, method_overrides
from tests.helpers import sgd_weight_bound, worker_job
from tests.tolerances import LOSS_RTOL, adamw_same_grads_atol, difference_atol

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.distributed


def single(out, overrides_: list[str]):
    from workbench.run.runner import Runner

    runner = Runner(compose([*overrides_, "backend=single", "train.grad_accum=2"], out))
    res = runner.train()
    return res, {k: v.detach().clone() for k, v in runner.model.named_parameters() if v.requires_grad}, out


def check(label, got, ref, trainable, atol: float = 0.0) -> None:
    from safetensors.torch import load_file

    res, ref_weights, ref_dir = ref
    assert len(got["losses"]) == len(res["losses"]), label
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], res["losses"]))
    weights = load_file(trainable)
    assert set(weights) == set(ref_weights), (label, sorted(set(weights) ^ set(ref_weights))[:4])
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    bound = sgd_weight_bound(ref_dir, ref_weights)
    print(f"{label}: losses rel diff {loss_diff:.2e} (rtol {LOSS_RTOL:.0e}), trained tensors max abs diff "
          f"{worst:.2e} (bound {bound:.2e})")
    assert got["losses"] == pytest.approx(res["losses"], rel=LOSS_RTOL, abs=atol), (label, got["losses"], res["losses"])
    assert worst < bound, (label, worst, bound)


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory, teacher):
    out = tmp_path_factory.mktemp("megatron_slow") / "meg"
    runs = [{"name": n, "overrides": [*method_overrides(n, teacher), *TP2], "save_trainable": True}
            for n in METHODS if n not in FAST]
    return worker_job(runs, out, timeout=2400), out


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in METHODS])
def test_method_at_tp2_equals_single(request, teacher, tmp_path, name):
    got, out = request.getfixturevalue("megatron_default" if name in FAST else "slow_job")
    ref = single(tmp_path / "single", method_overrides(name, teacher))
    # A divergence is a p-weighted sum of log-prob differences: its rounding scales with the
    # log-probs it subtracts (about log V), not with its own (small) value: difference_atol.
    atol = difference_atol(math.log(compose([]).model.arch.vocab)) if name == "distill" else 0.0
    check(f"{name} tp2", got[name], ref, out / name / "trainable.safetensors", atol)


def test_distributed_optimizer_at_dp2_equals_single(megatron_default, tmp_path):
    from safetensors.torch import load_file

    got, out = megatron_default
    res, _, ref_dir = single(tmp_path / "adamw", ADAMW)
    mine = got["dp2-distopt"]
    ref_norms = [r["grad_norm"] for r in map(json.loads, (ref_dir / "metrics.jsonl").read_text().splitlines())
                 if "grad_norm" in r]
    print(f"distributed optimizer dp2: losses {mine['losses']} vs single {res['losses']}; grad norms "
          f"{mine['grad_norms']} vs {ref_norms}")
    assert mine["losses"] == pytest.approx(res["losses"], rel=LOSS_RTOL)
    # the gradient: its global norm, summed over the ranks' shards (Megatron's clip), as single's
    assert mine["grad_norms"] == pytest.approx(ref_norms, rel=LOSS_RTOL)
    # Against Megatron with a torch AdamW at the same dp=2: the same gradients (a sum of two
    # ranks' terms, in either order), the same elementwise AdamW (unclipped: optim.max_grad_norm=0),
    # so the same weights up to the roundings of one update per step (tests/tolerances.py).
    a, b = (load_file(out / n / "trainable.safetensors") for n in ("dp2-distopt", "dp2-torch"))
    assert set(a) == set(b)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    bound = adamw_same_grads_atol(2, 1e-3, max(float(v.abs().max()) for v in b.values()))
    print(f"distributed optimizer vs torch AdamW at dp2: weights max abs diff {worst:.2e} (bound {bound:.2e})")
    assert worst <= bound, (worst, bound)
    # Each of the 2 data-parallel ranks holds the Adam moments (2 x fp32) of its half of the
    # parameters (Megatron pads each bucket to a multiple of the data-parallel size: < 1%).
    from workbench.models.load import load_model

    half = 4 * sum(p.numel() for p in load_model(compose([]).model).parameters())  # 8 bytes / 2 ranks
    held = mine["bytes"]["optimizer"], mine["rank1"]["bytes"]["optimizer"]
    assert all(abs(h - half) <= 0.01 * half for h in held), (held, half)
    torch_held = got["dp2-torch"]["bytes"]["optimizer"]
    assert abs(torch_held - 2 * half) <= 0.01 * half, torch_held  # the torch optimizer: all of them
