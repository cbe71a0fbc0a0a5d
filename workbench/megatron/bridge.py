"""HF <-> Megatron-Core weights for Llama, Qwen2, Qwen3 and Mixtral, with TP shards and PP stages.

    local = to_megatron(hf_state, hf_config, rank_layout())   # this rank's GPTModel tensors
    load_into(gpt, local)
    hf_state = to_hf(gpt, hf_config, rank_layout())            # gathered on every rank

Layouts (Megatron-Core local spec, `decoder.layers.<local index>`):
- fused QKV `self_attention.linear_qkv`: per query group g, [q heads of g | k_g | v_g]; groups
  are split contiguously over TP ranks. Because HF's q rows are ordered head by head and
  query head h reads kv head h // (heads/groups), TP rank r's q rows are HF's block r.
- fused gate/up `mlp.linear_fc1`: TP rank r holds [gate block r ; up block r].
- row-parallel `linear_proj`, `linear_fc2`: column block r. Embedding and output layer: vocab
  rows, padded with zero rows to a multiple of TP (padding dropped on the way back).
- PP: stage s holds global layers [s*L/pp, (s+1)*L/pp); the embedding lives on the first stage,
  the final norm and output layer on the last (a tied output layer is a copy of the embedding).
- Mixtral experts (HF v5 fused `experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]):
  expert e lives on EP rank e // (E/ep) as `mlp.experts.local_experts.<e mod E/ep>`, its fc1/fc2
  split over expert-TP like a dense MLP; `mlp.gate` is `mlp.router`.

`merged_hf_state(model)` gives an HF model's weights with LoRA adapters folded in
(W + scale * B @ A), which is what `to_megatron` and exports take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.core.errors import UserError
from workbench.families import registry as families
from workbench.megatron.model import family, head_dim, mapping, n_experts, padded_vocab

ADAPTER = ".lora."  # GPTModel parameter names of LoRA adapters (lora.is_adapter)


@dataclass(frozen=True)
class ShardLayout:
    """This rank's place in Megatron-Core's model parallel groups: which tensor, pipeline and
    expert shard of the GPTModel it holds (the run's ranks and degrees are train/layout.py's Layout)."""

    tp: int = 1
    tp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1  # expert tensor-parallel size
    etp_rank: int = 0


def rank_layout() -> ShardLayout:
    """This rank's place in Megatron-Core's initialised parallel state."""
    from megatron.core import parallel_state as ps

    return ShardLayout(ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                  ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank(),
                  ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank(),
                  ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank())


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    per = n_layers // pp
    return range(stage * per, (stage + 1) * per)


def _block(t: torch.Tensor, n: int, r: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(n, dim=dim)[r].clone()


def _vocab_rows(t: torch.Tensor, vp: int, tp: int, r: int) -> torch.Tensor:
    if t.shape[0] < vp:
        t = torch.cat([t, t.new_zeros(vp - t.shape[0], *t.shape[1:])])
    return _block(t, tp, r)


# -- HF -> Megatron -----------------------------------------------------------------------------
def to_megatron(hf: dict, cfg, lay: ShardLayout) -> dict:
    """This rank's Megatron-Core tensors (its TP shard of its PP stage) from a full HF state dict."""
    fam = mapping(cfg)
    out: dict[str, torch.Tensor] = {}
    tp, r = lay.tp, lay.tp_rank
    ng, nh, hd = cfg.num_key_value_heads, cfg.num_attention_heads, head_dim(cfg)
    vp = padded_vocab(cfg, tp)
    first, last = lay.pp_rank == 0, lay.pp_rank == lay.pp - 1
    if first:
        out["embedding.word_embeddings.weight"] = _vocab_rows(hf["model.embed_tokens.weight"], vp, tp, r)
    for j, i in enumerate(stage_layers(cfg.num_hidden_layers, lay.pp, lay.pp_rank)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{j}."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        for suffix in ("weight", "bias") if fam.qkv_bias else ("weight",):
            q, k, v = (hf[f"{h}self_attn.{p}_proj.{suffix}"] for p in "qkv")
            rest = q.shape[1:]
            fused = torch.cat([q.reshape(ng, nh // ng * hd, *rest), k.reshape(ng, hd, *rest),
                               v.reshape(ng, hd, *rest)], dim=1)
            out[m + f"self_attention.linear_qkv.{suffix}"] = _block(fused, tp, r).reshape(-1, *rest)
        out[m + "self_attention.linear_proj.weight"] = _block(hf[h + "self_attn.o_proj.weight"], tp, r, 1)
        if families.get(family(cfg)).qk_norm:
            out[m + "self_attention.q_layernorm.weight"] = hf[h + "self_attn.q_norm.weight"].clone()
            out[m + "self_attention.k_layernorm.weight"] = hf[h + "self_attn.k_norm.weight"].clone()
        if n_experts(cfg):
            _experts_to_megatron(hf, h, m, cfg, lay, out)
        else:
            gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
            out[m + "mlp.linear_fc1.weight"] = torch.cat([_block(gate, tp, r), _block(up, tp, r)])
            out[m + "mlp.linear_fc2.weight"] = _block(hf[h + "mlp.down_proj.weight"], tp, r, 1)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if hf.get("lm_head.weight") is not None and hf["lm_head.weight"].shape[0] == 1:
            out["output_layer.weight"] = hf["lm_head.weight"].clone()  # scalar head (method=rm), replicated
        elif not cfg.tie_word_embeddings:
            out["output_layer.weight"] = _vocab_rows(hf["lm_head.weight"], vp, tp, r)
        elif lay.pp > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = _vocab_rows(hf["model.embed_tokens.weight"], vp, tp, r)
    return out


def _experts_to_megatron(hf, h, m, cfg, lay: ShardLayout, out) -> None:
    experts = n_experts(cfg)
    per = experts // lay.ep
    out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"].clone()
    gate_up, down = hf[h + "mlp.experts.gate_up_proj"], hf[h + "mlp.experts.down_proj"]
    f = gate_up.shape[1] // 2
    for k in range(per):
        e = lay.ep_rank * per + k
        gate, up = gate_up[e, :f], gate_up[e, f:]
        x = f"{m}mlp.experts.local_experts.{k}."
        out[x + "linear_fc1.weight"] = torch.cat([_block(gate, lay.etp, lay.etp_rank),
                                                  _block(up, lay.etp, lay.etp_rank)])
        out[x + "linear_fc2.weight"] = _block(down[e], lay.etp, lay.etp_rank, 1)


def load_into(gpt: torch.nn.Module, local: dict) -> None:
    """Copy `local` into the model; every parameter must be covered and every tensor used
    (LoRA adapters have their own mapping, workbench/megatron/lora.py)."""
    params = {n: p for n, p in gpt.named_parameters() if ADAPTER not in n}
    missing = sorted(set(params) - set(local))
    extra = sorted(set(local) - set(params))
    if missing or extra:
        raise RuntimeError(f"bridge/model mismatch: missing {missing[:4]}, unexpected {extra[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != local[name].shape:
                raise RuntimeError(f"{name}: model shape {tuple(p.shape)} != bridged {tuple(local[name].shape)}")
            p.copy_(local[name])


# -- Megatron -> HF -----------------------------------------------------------------------------
def pieces(pairs, cfg, lay: ShardLayout) -> list[tuple[str, tuple, int, torch.Tensor]]:
    """(hf name, order key, concat dim, tensor) for every local (Megatron name, tensor) pair: a
    parameter, or anything laid out like one (an Adam moment: the mapping is elementwise).
    The order key is () for a tensor replicated over TP, else the key of its block."""
    fam = family(cfg)
    ng, nh, hd = cfg.num_key_value_heads, cfg.num_attention_heads, head_dim(cfg)
    r = lay.tp_rank
    layers = list(stage_layers(cfg.num_hidden_layers, lay.pp, lay.pp_rank))
    out = []
    for name, p in pairs:
        if ADAPTER in name:
            continue  # adapters: workbench/megatron/lora.py
        t = p.detach().to("cpu", copy=True)
        parts = name.split(".")
        if name == "embedding.word_embeddings.weight":
            out.append(("model.embed_tokens.weight", (r,), 0, t))
        elif name == "output_layer.weight":
            if t.shape[0] == 1:  # a reward model's scalar head: replicated, unpadded
                out.append(("lm_head.weight", (), 0, t))
            elif not cfg.tie_word_embeddings:
                out.append(("lm_head.weight", (r,), 0, t))
        elif name == "decoder.final_layernorm.weight":
            out.append(("model.norm.weight", (), 0, t))
        elif parts[0] == "decoder" and parts[1] == "layers":
            h = f"model.layers.{layers[int(parts[2])]}."
            rest = ".".join(parts[3:])
            out.extend(_layer_pieces(h, rest, t, fam, ng, nh, hd, lay))
        else:
            raise RuntimeError(f"no HF name for Megatron parameter {name}")
    return out


def _layer_pieces(h, rest, t, fam, ng, nh, hd, lay: ShardLayout):
    r = lay.tp_rank
    simple = {"input_layernorm.weight": "input_layernorm.weight",
              "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
              "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
              "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
              "mlp.router.weight": "mlp.gate.weight"}
    if rest in simple:
        return [(h + simple[rest], (), 0, t)]
    if rest.startswith("self_attention.linear_qkv."):
        suffix = rest.rsplit(".", 1)[1]
        shape = t.shape[1:]
        g = t.reshape(ng // lay.tp, (nh // ng + 2) * hd, *shape)
        q, k, v = g.split([nh // ng * hd, hd, hd], dim=1)
        return [(f"{h}self_attn.{n}_proj.{suffix}", (r,), 0, x.reshape(-1, *shape).clone())
                for n, x in (("q", q), ("k", k), ("v", v))]
    if rest == "self_attention.linear_proj.weight":
        return [(h + "self_attn.o_proj.weight", (r,), 1, t)]
    if rest == "mlp.linear_fc1.weight":
        gate, up = t.chunk(2)
        return [(h + "mlp.gate_proj.weight", (r,), 0, gate.clone()), (h + "mlp.up_proj.weight", (r,), 0, up.clone())]
    if rest == "mlp.linear_fc2.weight":
        return [(h + "mlp.down_proj.weight", (r,), 1, t)]
    if rest.startswith("mlp.experts.local_experts."):
        k, what = int(rest.split(".")[3]), rest.split(".", 4)[4]
        e = (lay.ep_rank, k)
        er = lay.etp_rank
        if what == "linear_fc1.weight":
            gate, up = t.chunk(2)
            return [(f"{h}#expert.gate", e + (er,), 0, gate.clone()), (f"{h}#expert.up", e + (er,), 0, up.clone())]
        if what == "linear_fc2.weight":
            return [(f"{h}#expert.down", e + (er,), 1, t)]
    raise RuntimeError(f"no HF name for Megatron parameter {h}{rest}")


def to_hf(gpt: torch.nn.Module, cfg, lay: ShardLayout, group=None, keep=None) -> dict:
    """The full HF state dict, gathered from every TP/PP/EP rank onto every rank (CPU tensors);
    `keep(megatron name)`: only those parameters."""
    mine = pieces(((n, p) for n, p in gpt.named_parameters() if keep is None or keep(n)), cfg, lay)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)  # in-process tensors, never from files
    else:
        everyone = [mine]
    return assemble(everyone, cfg)


def assemble(everyone: list, cfg) -> dict:
    """Whole HF tensors from the `pieces` of every rank (of one layout)."""
    by_name: dict[str, dict[tuple, tuple[int, torch.Tensor]]] = {}
    for part in everyone:
        for name, key, dim, t in part:
            by_name.setdefault(name, {}).setdefault(key, (dim, t))  # data-parallel copies: keep one
    out = {}
    experts: dict[str, dict] = {}
    for name, parts in by_name.items():
        if "#expert." in name:
            experts[name] = parts
            continue
        keys = sorted(parts)
        out[name] = torch.cat([parts[k][1] for k in keys], dim=parts[keys[0]][0]) if len(keys) > 1 \
            else parts[keys[0]][1]
    if experts:
        _assemble_experts(experts, out)
    v = cfg.vocab_size
    if "model.embed_tokens.weight" in out:
        out["model.embed_tokens.weight"] = out["model.embed_tokens.weight"][:v].clone()
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["lm_head.weight"][:v].clone()
    elif cfg.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # HF state dicts list the tied head too
    return out


def _assemble_experts(experts: dict, out: dict) -> None:
    layers = sorted({n.split("#")[0] for n in experts})
    for h in layers:
        stacked = {}
        for what in ("gate", "up", "down"):
            parts = experts[f"{h}#expert.{what}"]
            by_expert: dict[tuple, list] = {}
            for (ep_rank, k, _er), (dim, t) in sorted(parts.items()):
                by_expert.setdefault((ep_rank, k), []).append((dim, t))
            stacked[what] = torch.stack([torch.cat([t for _, t in ts], dim=ts[0][0]) for _, ts in
                                         sorted(by_expert.items())])
        out[h + "mlp.experts.gate_up_proj"] = torch.cat([stacked["gate"], stacked["up"]], dim=1)
        out[h + "mlp.experts.down_proj"] = stacked["down"]


# -- LoRA ---------------------------------------------------------------------------------------
def merged_hf_state(model: torch.nn.Module) -> dict:
    """HF-named weights of `model` (plain or PEFT) with LoRA adapters folded into the base weights."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no PEFT installed means no adapters to merge
        PeftModel, LoraLayer = (), ()
    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    base = model.get_base_model()
    merged = {}
    for mod_name, mod in base.named_modules():
        if isinstance(mod, LoraLayer):
            if any(mod.use_dora.get(a, False) for a in mod.active_adapters):
                raise UserError("peft=dora cannot be merged into Megatron weights; use peft=lora or none")
            w = mod.get_base_layer().weight.detach()
            for a in mod.active_adapters:
                w = w + mod.get_delta_weight(a).to(w.dtype)
            merged[f"{mod_name}.weight"] = w
    out = {}
    for k, v in base.state_dict().items():
        if "lora_" in k:
            continue
        k2 = k.replace(".base_layer.", ".")
        out[k2] = merged.get(k2, v.detach())
    return out
