"""HF <-> Megatron-Core bridge on 2 CPU processes (gloo): round trips and logits against HF.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/distributed/test_megatron_bridge.py

The test launches this file under torch.distributed.run; the worker (bottom) builds each small
model family, bridges its weights to Megatron-Core with the requested TP/PP, compares logits
with the HF model's and bridges back, and writes what it measured to a JSON file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import torchrun
from tests.tolerances import LOSS_RTOL

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve()


def launch(args: list[str], out: Path, timeout: int = 240) -> dict:
    torchrun(HERE, ["--out", out, *args], timeout)
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_tp2_pp2_ep2_round_trip_and_logits(tmp_path):
    res = launch(["--layouts", "tp2,pp2,ep2"], tmp_path / "res.json")
    for case, r in res.items():
        assert r["round_trip_identical"], case
        # the same fp32 sums split over ranks and in other kernels: tests/tolerances.py scale_atol,
        # LOSS_RTOL of the largest logit
        assert r["max_abs_logit_diff"] <= LOSS_RTOL * r["max_abs_logit"], (case, r)
        assert r["n_tensors"] > 0
    # Every family ran under TP=2, the tiny Llama under PP=2, Mixtral's experts split over EP=2.
    assert {"tiny/tp2", "tiny/pp2", "qwen2/tp2", "qwen3/tp2", "mixtral/tp2", "mixtral/ep2"} <= set(res)


# -- worker ---------------------------------------------------------------------------------------
def families():
    import transformers as tf
    from omegaconf import OmegaConf

    from workbench.models.load import hf_config

    tiny = hf_config(OmegaConf.load(ROOT / "conf/model/tiny.yaml").arch)
    small = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
    return {
        "tiny": tiny,
        "qwen2": tf.Qwen2Config(**small),
        "qwen3": tf.Qwen3Config(**small),
        "mixtral": tf.MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2),
    }


def worker(out: str, layouts: list[str]) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM

    from workbench.megatron import bridge
    from workbench.megatron.attention import attention_mask
    from workbench.megatron.cpu_shim import cpu_device
    from workbench.megatron.model import Parallel, build_gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {}
    for layout in layouts:
        par = {"tp2": Parallel(tp=2), "pp2": Parallel(pp=2), "ep2": Parallel(ep=2)}[layout]
        ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                     expert_model_parallel_size=par.ep)
        for name, cfg in families().items():
            if (layout == "pp2" and name != "tiny") or (layout == "ep2" and name != "mixtral"):
                continue
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            with torch.no_grad():  # norms start at 1: perturb them so a swapped norm would show
                for n, p in hf.named_parameters():
                    if n.endswith("norm.weight"):
                        p.add_(0.1 * torch.randn_like(p))
            state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
            lay = bridge.rank_layout()
            gpt = build_gpt(cfg, par, torch.float32).eval()
            bridge.load_into(gpt, bridge.to_megatron(state, cfg, lay))
            back = bridge.to_hf(gpt, cfg, lay)
            same = set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
            g = torch.Generator().manual_seed(1)
            ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=g)
            pad = torch.ones_like(ids)
            pad[1, 9:] = 0  # right padding on the second row
            with torch.no_grad():
                ref = hf(input_ids=ids, attention_mask=pad).logits
                diff = _megatron_logits_diff(gpt, ids, pad, ref, par, cfg, attention_mask, cpu_device,
                                             gather_from_tensor_model_parallel_region)
            results[f"{name}/{layout}"] = {"round_trip_identical": bool(same), "max_abs_logit_diff": diff,
                                           "max_abs_logit": float(ref[pad.bool()].abs().max()),
                                           "n_tensors": len(back)}
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _megatron_logits_diff(gpt, ids, pad, ref, par, cfg, attention_mask, cpu_device, gather):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = ids.shape
    pos = torch.arange(s).expand(b, s)
    mask = attention_mask(pad, s, b, ids.device)
    keep = pad.bool()
    with cpu_device():
        if par.pp == 1:
            logits = gather(gpt(ids, pos, mask))
            logits = logits[..., :cfg.vocab_size]
            return float((logits[keep] - ref[keep]).abs().max())
        # PP=2 by hand: stage 0's hidden states are sent to stage 1.
        hidden_shape = (s, b, cfg.hidden_size)
        if ps.is_pipeline_first_stage():
            hidden = gpt(ids, pos, mask)
            dist.send(hidden.contiguous(), dst=1)
            got = torch.empty(1)
            dist.recv(got, src=1)
            return float(got.item())
        hidden = torch.empty(hidden_shape)
        dist.recv(hidden, src=0)
        gpt.set_input_tensor(hidden)
        logits = gpt(ids, pos, mask)[..., :cfg.vocab_size]
        diff = float((logits[keep] - ref[keep]).abs().max())
        dist.send(torch.tensor([diff]), dst=0)
        return diff


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="tp2,pp2")
    a = ap.parse_args()
    worker(a.out, a.layouts.split(","))
