"""Exact parameter counts from a one-block model on the meta device.

A decoder-only model is embeddings + L identical blocks + final norm + head, so building one
block on the meta device (no memory, no weights) and multiplying gives the exact count for any
depth in well under a second, even for 70B or Mixtral 8x22B. `tests/unit/test_plan.py`
checks the extrapolation against a full meta build.

    from workbench.plan.counts import probe, count
    c = count(probe(cfg.model), cfg.model.arch, cfg.peft)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.models import load
from workbench.models.auto import meta_model
from workbench.peft.lora import target_names


@dataclass(frozen=True)
class Counts:
    total: int  # every parameter (tied embeddings once)
    active: int  # parameters one token passes through (MoE: k of E experts)
    per_block: int
    block_linear: int  # Linear weights inside the blocks (what QLoRA stores as NF4), all blocks
    embed: int  # input embeddings + untied head
    lora: int  # adapter parameters for the peft config (0 for peft=none)
    layers: int
    # of `lora`, what tensor parallelism splits under backend=megatron: B of a column-parallel
    # projection (q, k, v, gate, up), A of a row-parallel one (o, down); the rest is replicated
    lora_split: int = 0


def probe(model_cfg) -> nn.Module:
    """The model with one decoder block, built on the meta device.

    A model given by path or hub id (`model.arch_from` set) is built whole from its own config:
    its blocks need not be identical (Gemma's sliding/full layers, MoE every k-th layer), and
    a whole meta build is cheap (about half a second for 8B)."""
    from transformers import AutoModelForCausalLM

    if getattr(model_cfg, "arch_from", None):
        return meta_model(model_cfg)
    cfg = load.hf_config(model_cfg.arch)
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def build_full(model_cfg) -> nn.Module:
    """The whole model on the meta device (slow for 70B; used to check `count`)."""
    return load.build_meta(model_cfg)  # through the module: tests replace it to prove nothing loads


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


ROW_PARALLEL = ("o_proj", "down_proj")  # input-split projections under Megatron's tensor parallelism


def lora_params(block: nn.Module, targets: list[str], r: int, dora: bool = False, split: bool = False) -> int:
    """Adapter parameters in one block: r*(in+out) per targeted Linear (+ out for DoRA's magnitude);
    `split`: only those Megatron's tensor parallelism splits (Counts.lora_split)."""
    n = 0
    for full, mod in block.named_modules():
        name = full.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear) and name in targets:
            if split:
                n += r * (mod.in_features if name in ROW_PARALLEL else mod.out_features)
            else:
                n += r * (mod.in_features + mod.out_features) + (mod.out_features if dora else 0)
    return n


def blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: `model.model.layers` for Llama-like models, else the longest ModuleList."""
    inner = getattr(model, "model", None)
    if isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return inner.layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__}: no decoder blocks found")
    return max(lists, key=len)


def count(model: nn.Module, arch, peft_cfg=None) -> Counts:
    """Exact counts for `arch.layers` blocks from a model built with one block (or all of them)."""
    built = blocks(model)
    block = built[0]
    per_block = _numel(block)
    layers = int(arch.layers)
    total = _numel(model) + (layers - len(built)) * per_block
    linear = sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear))
    experts = sum(p.numel() for n, p in block.named_parameters() if ".experts." in f".{n}")
    active = total
    if arch.experts and experts:
        active = total - layers * experts * (1 - arch.experts_per_token / arch.experts)
    embed = _numel(model) - sum(_numel(b) for b in built) - sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("model.norm"))
    n_lora = n_split = 0
    if peft_cfg is not None and peft_cfg.kind != "none":
        targets = target_names(model, peft_cfg.target_modules)  # UserError if a target is missing
        n_lora = layers * lora_params(block, targets, peft_cfg.r, peft_cfg.kind == "dora")
        n_split = layers * lora_params(block, targets, peft_cfg.r, split=True)
    return Counts(total=total, active=int(active), per_block=per_block, block_linear=layers * linear,
                  embed=embed, lora=n_lora, layers=layers, lora_split=n_split)
