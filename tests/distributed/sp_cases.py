"""Sequence parallelism against whole rows, loss by loss, gradient element by gradient element.

    torchrun --nproc_per_node=2 tests/distributed/sp_cases.py OUT.json

Each case computes a method's own loss function (SFT over packed rows, DPO over pairs, GRPO's
policy loss at token and sequence level, ORPO) on rows of 2,048+ tokens twice: first with no sp
group (every rank the whole rows), then at backend.sp=2 (each rank half of every row). Under sp
each rank holds the whole loss and its gradients are that rank's share, counted once per sp rank
(workbench/train/sequence_parallel.py), so the sum of the ranks' gradients over sp is the
whole-row gradient. Rank 0 writes, per case, the two losses and per parameter the largest
difference and the largest |element| of the reference; tests/distributed/test_sequence_parallel.py
holds them to LOSS_RTOL and scale_atol.

Models: the tiny Llama (4 heads, 2 key/value heads: both split evenly) and a 3-head,
1-key/value-head Llama built here (heads split 2 + 1, key/value repeated first), SmolLM2-135M's
case (9 and 3 heads) in miniature.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SEQ = 2048


def tiny(heads: int, kv: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=16 * heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, max_position_embeddings=4096,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).float()


def examples(g, lengths, answer: int):
    out = []
    for n in lengths:
        ids = torch.randint(3, 4000, (n,), generator=g).tolist()
        out.append((ids, [-100] * (n - answer) + ids[n - answer:]))
    return out


def cases(g):
    """name -> (micro-batch, loss function(model, micro) -> scalar)."""
    from workbench.data.collate import pack_rows, pad_batch
    from workbench.methods import dpo, grpo, orpo, sft
    from workbench.methods.logps import collate
    from workbench.rollout import objectives

    out = {}
    # SFT: 2 packed rows of 2,048+ positions, 40-300-token examples, answer-only targets; the
    # block-diagonal mask of the SDPA layout (collate.pack_rows) is the reference
    rows = []
    for _ in range(2):
        lens, row = [], 0
        while row < SEQ:
            n = int(torch.randint(40, 300, (1,), generator=g))
            lens.append(n)
            row += n
        rows.append(examples(g, lens, 20))
    out["sft_packed"] = (pack_rows(rows, 0, "rows", "4d"), lambda m, x: sft.SFT.loss(None, m, x)[0])

    # DPO: 2 pairs whose prompts are 2,000+ tokens, two right-padded rows per pair
    pairs = []
    for _ in range(2):
        prompt = torch.randint(3, 4000, (int(torch.randint(2000, 2100, (1,), generator=g)),), generator=g).tolist()
        pair = []
        for n in (int(torch.randint(5, 40, (1,), generator=g)), int(torch.randint(5, 40, (1,), generator=g))):
            ans = torch.randint(3, 4000, (n,), generator=g).tolist()
            pair.append((prompt + ans, [-100] * len(prompt) + ans))
        pairs.append(SimpleNamespace(chosen=pair[0], rejected=pair[1]))
    micro = collate(pairs, 0)
    ref = torch.randn(4, generator=g) * 5 - 200  # precomputed reference log-probs, chosen then rejected
    cfg = dpo.Config(rpo_alpha=0.5)
    me = SimpleNamespace(cfg=cfg, _pairs_in_step=2, _reference=lambda m, x: ref.chunk(2))
    out["dpo"] = (micro, lambda m, x: dpo.DPO.loss(me, m, x)[0])
    orpo_me = SimpleNamespace(cfg=orpo.Config(), stream=SimpleNamespace(nll_scale=1.0 / 60, pairs=2, nll_tokens_rank=60))
    out["orpo"] = (micro, lambda m, x: orpo.ORPO.loss(orpo_me, m, x)[0])

    # GRPO's training pass: 4 completions after 2,000+ token prompts, old log-probs off the
    # current policy's so the ratios are live, token- and sequence-level importance
    m = pad_batch(examples(g, [2100, 2050, 2080, 2030], 30), 0)
    m["n_tokens"] = m["select"].sum(dim=1)
    m["target_seq"] = m["select"].nonzero()[:, 0]
    m["advantages"] = torch.tensor([1.0, -0.5, 0.25, -0.75])
    m["old_logps"] = -8.3 + 0.1 * torch.randn(m["targets"].shape[0], generator=g)
    for level in ("token", "sequence"):
        gcfg = grpo.Config(loss_type="grpo", importance_sampling_level=level)
        objectives.check(gcfg)
        me_g = SimpleNamespace(cfg=gcfg, _step_tokens=float(m["n_tokens"].sum()))
        out[f"grpo_{level}"] = (m, lambda mod, x, me_g=me_g: grpo.GRPO.loss(me_g, mod, x)[0])
    return out


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run(lm, micro, loss_fn, sp_mod):
    lm.zero_grad(set_to_none=True)
    with sp_mod.rows(micro) as local:
        loss = loss_fn(lm, local)
        loss.backward()
    return float(loss.detach()), grads(lm.inner)


def main() -> None:
    from workbench.models.head import SelectiveLM
    from workbench.train import sequence_parallel as sp

    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True, warn_only=True)
    sp_size = dist.get_world_size()
    report = {}
    for model_name, (heads, kv) in {"llama_4h_2kv": (4, 2), "llama_3h_1kv": (3, 1)}.items():
        lm = SelectiveLM(tiny(heads, kv))
        g = torch.Generator().manual_seed(1)
        all_cases = cases(g)
        sp.setup(1)
        whole = {name: run(lm, micro, fn, sp) for name, (micro, fn) in all_cases.items()}
        sp.start(sp_size, lm)
        for name, (micro, fn) in all_cases.items():
            loss, got = run(lm, micro, fn, sp)
            want_loss, want = whole[name]
            diffs = {}
            for k, ref in want.items():
                mine = got[k].clone()
                dist.all_reduce(mine)  # the sp ranks' shares ...
                mine /= sp_size  # ... each counted once per sp rank (the loss is whole on every rank)
                diffs[k] = [float((mine - ref).abs().max()), float(ref.abs().max())]
            report[f"{model_name}/{name}"] = {"loss": loss, "whole_loss": want_loss, "grads": diffs,
                                              "tokens": int(micro["input_ids"].shape[1])}
        sp.setup(1)
        lm.inner.config._attn_implementation = "sdpa"
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
