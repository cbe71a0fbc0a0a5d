"""backend=megatron trains like backend=single: SFT loss curves at equal global batch, DPO runs,
checkpoints resume (2 CPU processes, gloo; resuming at other layouts: tests/distributed/test_resume_moves.py).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_megatron_train.py

Each test launches this file under torch.distributed.run; the worker (bottom) runs the real
runner on the tiny model and rank 0 writes the results as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import sgd_weight_bound, torchrun
from tests.tolerances import LOSS_RTOL

# the slow tier: the default tier trains Megatron like single in test_megatron_lora.py,
# test_megatron_methods.py and the family matrix's Megatron cells
pytestmark = pytest.mark.slow

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()
# Plain SGD, so that a weight's error stays proportional to its gradients' error. Under AdamW the
# update lr * m / (sqrt(v) + eps) of a weight whose gradient is near 0 changes by up to lr / eps
# per unit of gradient error (1e5 at lr 1e-3, eps 1e-8), so a last-bit difference in a tiny
# gradient moves that weight by ~1e-5, and no bound derived from the arithmetic stays tight.
SFT = ["peft=none", "optim.name=sgd", "optim.lr=0.1", "train.max_steps=3", "train.micro_batch_size=2",
       "train.grad_accum=2"]
# Losses: TP splits the matmuls and the vocab-parallel log-sum-exp, another summation order:
# LOSS_RTOL (tests/tolerances.py).
RTOL = LOSS_RTOL


def launch(out: Path, overrides: list[str], timeout: int = 300) -> dict:
    res = out / "result.json"
    torchrun(HERE, [out, res, *overrides], timeout, python_flags=("-W", "ignore"))
    return json.loads(res.read_text())


def run_here(out: Path, overrides: list[str]):
    """Run in this process; (results, the HF model's final weights)."""
    from tests.conftest import compose
    from workbench.run.runner import Runner

    runner = Runner(compose(overrides, out))
    res = runner.train()
    return res, {k: v.detach().clone() for k, v in runner.model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    ["backend.tp=2"],
    pytest.param(["backend.pp=2"], marks=pytest.mark.slow),  # ~1 min more; the bridge test covers PP=2
    pytest.param(["backend.tp=2", "backend.recompute=full"], marks=pytest.mark.slow),
    pytest.param(["backend.tp=2", "backend.recompute=selective"], marks=pytest.mark.slow),
], ids=["tp2", "pp2", "tp2-recompute-full", "tp2-recompute-selective"])
def test_sft_curve_equals_single(tmp_path, layout):
    from safetensors.torch import load_file

    ref, ref_weights = run_here(tmp_path / "single", SFT + ["backend=single"])
    got = launch(tmp_path / "meg", SFT + ["backend=megatron", *layout])
    assert len(got["losses"]) == len(ref["losses"]) == 3
    # Forwards of this rank's transformer layers and of their core attention: 3 steps x 2
    # micro-batches, and again in the backward pass for what backend.recompute recomputes
    # (full: whole layers; selective: the core attention only).
    recompute = next((x.split("=")[1] for x in layout if x.startswith("backend.recompute=")), "none")
    n = 3 * 2
    # plus one forward without gradient (nothing recomputed) per checkpoint's replay probe
    assert got["probes"] >= 1
    assert got["layer_calls"] and set(got["layer_calls"]) == {(2 * n if recompute == "full" else n) + got["probes"]}, got
    assert got["core_attn_calls"] == [(2 * n if recompute != "none" else n) + got["probes"]] * len(got["layer_calls"]), got
    assert got["losses"] == pytest.approx(ref["losses"], rel=RTOL), (got["losses"], ref["losses"])
    assert got["losses"][-1] < got["losses"][0]  # it learns
    # The HF model the runner exports / evaluates holds the trained weights, bridged back.
    weights = load_file(tmp_path / "meg" / "hf_final.safetensors")
    ref_weights.pop("lm_head.weight", None)  # tied to the embedding in the tiny model
    assert set(weights) == set(ref_weights)
    worst = max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights)
    bound = sgd_weight_bound(tmp_path / "single", ref_weights)
    assert worst < bound, (worst, bound)


@pytest.mark.distributed
@pytest.mark.slow  # three 2-process runs (~2.5 min on 2 cores)
def test_dpo_runs_and_checkpoint_resumes(tmp_path):
    base = ["method=dpo", "peft=none", "optim.lr=1e-4", "train.micro_batch_size=2", "backend=megatron",
            "backend.tp=2", "train.checkpoint_every=2"]
    full = launch(tmp_path / "full", base + ["train.max_steps=4"])
    assert len(full["losses"]) == 4 and all(x == x for x in full["losses"])  # finite, no NaN
    ckpt = tmp_path / "resumed" / "checkpoints"
    launch(tmp_path / "resumed", base + ["train.max_steps=2"])
    # each TP rank writes its own blocks (workbench/checkpoints/canonical.py), no gather
    assert len(list((ckpt / "step-00000002" / "canonical").glob("shard-*.safetensors"))) == 2
    resumed = launch(tmp_path / "resumed", base + ["train.max_steps=4"])
    assert resumed["resumed_from"]
    # the checkpoint restores weights, optimizer, data position and RNG: the same arithmetic again
    assert resumed["losses"] == full["losses"][2:]


# -- worker ---------------------------------------------------------------------------------------
if __name__ == "__main__":
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from safetensors.torch import save_file

    from workbench.megatron import model as megatron_model

    torch.use_deterministic_algorithms(True, warn_only=True)
    build, layers, cores = megatron_model.build_gpt, [], []

    def count(module, calls: list[int]) -> None:
        i = len(calls)
        calls.append(0)
        # a pre-hook: it also sees a recomputation that stops before the module's forward ends
        module.register_forward_pre_hook(lambda *_: calls.__setitem__(i, calls[i] + 1))

    def counting_build(*args, **kwargs):  # count forwards of each layer and its core attention
        gpt = build(*args, **kwargs)
        for layer in gpt.decoder.layers:
            count(layer, layers)
            count(layer.self_attention.core_attention, cores)
        return gpt

    megatron_model.build_gpt = counting_build
    from workbench.checkpoints import replay

    probe, probes = replay.probe_loss_of, []

    def counting_probe(*args, **kwargs):  # each checkpoint's replay probe is one more forward
        probes.append(1)
        return probe(*args, **kwargs)

    replay.probe_loss_of = counting_probe
    out_dir, res_file, *ov = sys.argv[1:]
    r, final = run_here(Path(out_dir), ov)
    if dist.get_rank() == 0:
        Path(res_file).write_text(json.dumps({"losses": r["losses"], "resumed_from": r["resumed_from"],
                                              "layer_calls": layers, "core_attn_calls": cores, "probes": len(probes)}))
        save_file({k: v.contiguous() for k, v in final.items() if k != "lm_head.weight"},
                  Path(out_dir) / "hf_final.safetensors")
