"""LoRA on Megatron-Core's tensor-parallel linears, sharded the way the weights they adapt are.

    spec = lora.spec_of(peft_model)                 # r, scale, targets of the HF PeftModel
    adapters = lora.attach(gpt, hf_config, spec)    # freezes the base, hooks one adapter per linear
    lora.load(gpt, lora.peft_tensors(peft_model), hf_config, layout)   # PEFT's A/B -> this rank's shards
    full = lora.to_hf(gpt, hf_config, layout)       # {"model.layers.0.self_attn.q_proj.lora_A": ...}, gathered
    with lora.disabled(gpt): ...                    # the adapter-free base (reference=adapter)

Megatron-Core 0.16.1 has no adapter module, and Megatron-Bridge's LoRA imports Transformer
Engine at module level, needs Python 3.12 and a newer megatron-core, and puts one adapter on
the fused QKV / gate-up linears (not exportable as HF q/k/v, gate/up adapters); so the
adapters are written here, one per HF projection (PEFT's layout), with the HF convention
y = W x + s B A x, s = alpha / r:

- column-parallel base (`linear_qkv`, `linear_fc1`; TP rank t owns output rows O_t): A
  replicated, a = A x, then `copy_to_tensor_model_parallel_region(a)` (identity forward,
  all-reduce of the rank-r bottleneck's gradient backward: dA and dx are then complete);
  y_t += s B_t a with B split like the weight. The fused QKV holds, per query group, [q heads |
  k | v] and TP rank t's rows of each are HF's contiguous block t, so B_q, B_k, B_v are split in
  contiguous blocks and the three deltas are interleaved per group; gate/up as [gate_t ; up_t].
- row-parallel base (`linear_proj`, `linear_fc2`; rank t owns input columns I_t): A split like
  the weight, a = `reduce_from_tensor_model_parallel_region`(A_t x_t) (all-reduce forward of
  [s, b, r]), y += s B a with B replicated; dB is complete on every rank.
- sequence parallelism: the bottleneck is all-gathered / reduce-scattered over the sequence
  instead, and the replicated halves are marked `sequence_parallel` (their gradients cover
  this rank's tokens, summed over TP like the norms').

An adapter hangs on the module that owns the linear (`<layer>.self_attention.lora.linear_qkv.A.q`)
and adds its output through a forward hook, so base parameter names (and the bridge) stay as
they are. Mixture-of-experts experts carry no adapters: the workbench's PEFT targets nn.Linear
layers, and transformers' Mixtral experts are 3-D parameters (backend=single trains attention
adapters only, so does this). Dropout on the adapter input is refused (rule lora-megatron-dropout).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workbench.megatron.bridge import ADAPTER, ShardLayout, stage_layers
from workbench.megatron.model import head_dim

# HF projection -> (module of the Megatron layer that owns the linear, the linear, piece of a fused linear)
TARGETS = {
    "q_proj": ("self_attention", "linear_qkv", "q"),
    "k_proj": ("self_attention", "linear_qkv", "k"),
    "v_proj": ("self_attention", "linear_qkv", "v"),
    "o_proj": ("self_attention", "linear_proj", None),
    "gate_proj": ("mlp", "linear_fc1", "gate"),
    "up_proj": ("mlp", "linear_fc1", "up"),
    "down_proj": ("mlp", "linear_fc2", None),
}
HF_OWNER = {"self_attention": "self_attn", "mlp": "mlp"}
FUSED = {"linear_qkv": ("q", "k", "v"), "linear_fc1": ("gate", "up")}


@dataclass(frozen=True)
class Spec:
    r: int
    scale: float
    targets: tuple[str, ...]  # HF projection names
    adapter: str = "default"


def spec_of(peft_model) -> Spec:
    """r, scaling and target projections of the HF PeftModel the runner built (peft.lora.apply)."""
    name = peft_model.active_adapter
    cfg = peft_model.peft_config[name]
    layers = {n.rsplit(".", 1)[-1]: m for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and name in m.lora_A}
    scale = float(next(iter(layers.values())).scaling[name])
    return Spec(r=int(cfg.r), scale=scale, targets=tuple(sorted(layers)), adapter=name)


def _mark(p: nn.Parameter, split_dim: int | None, sequence_parallel: bool = False) -> nn.Parameter:
    """Tag a tensor the way Megatron-Core tags its own: split over TP (grad norm counts every
    rank's part) or replicated (counted once); `sequence_parallel`: gradient summed over TP."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if split_dim is None:
        p.tensor_model_parallel = False
    else:
        set_tensor_model_parallel_attributes(p, True, split_dim, 1)
    p.sequence_parallel = sequence_parallel
    return p


class Adapter(nn.Module):
    """Common part: scale, the TP group and the on/off switch; `_hook` adds the delta."""

    def __init__(self, base, scale: float):
        super().__init__()
        self.scale = scale
        self.group = base.tp_group
        self.tp = base.tp_group.size()
        self.sp = bool(getattr(base, "sequence_parallel", False))
        self.enabled = True
        base.register_forward_hook(self._hook)

    def _hook(self, module, inputs, out):
        if not self.enabled:
            return out
        y, bias = out
        return y + self(inputs[0]).to(y.dtype), bias


class ColumnLoRA(Adapter):
    """The adapters of one column-parallel linear: an (A, B) per adapted piece of its output.
    `rows`: every piece's local output rows, in output order (pieces without an adapter add
    zeros); `groups`: the fused QKV's local query groups, across which the pieces interleave."""

    def __init__(self, base, rows: dict[str, int], adapted: list[str], r: int, scale: float, groups: int = 1):
        super().__init__(base, scale)
        self.rows, self.groups = rows, groups
        self.A = nn.ParameterDict({p: _mark(nn.Parameter(torch.zeros(r, base.input_size)), None, self.sp)
                                   for p in adapted})
        self.B = nn.ParameterDict({p: _mark(nn.Parameter(torch.zeros(rows[p], r)), 0) for p in adapted})

    def forward(self, x):
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )

        names = list(self.A)
        a = F.linear(x, torch.cat([self.A[n] for n in names]).to(x.dtype))  # one matmul for every A
        if self.sp:
            a = gather_from_sequence_parallel_region(a, group=self.group)
        elif self.tp > 1:
            a = copy_to_tensor_model_parallel_region(a, group=self.group)
        parts = dict(zip(names, a.split(self.A[names[0]].shape[0], dim=-1)))
        lead = a.shape[:-1]
        out = []
        for p, n in self.rows.items():
            d = F.linear(parts[p], self.B[p].to(a.dtype)) * self.scale if p in parts else a.new_zeros(*lead, n)
            out.append(d.reshape(*lead, self.groups, n // self.groups))
        return torch.cat(out, dim=-1).reshape(*lead, -1)


class RowLoRA(Adapter):
    def __init__(self, base, r: int, scale: float):
        super().__init__(base, scale)
        self.A = _mark(nn.Parameter(torch.zeros(r, base.input_size_per_partition)), 1)
        self.B = _mark(nn.Parameter(torch.zeros(base.output_size, r)), None, self.sp)

    def forward(self, x):
        from megatron.core.tensor_parallel import (
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        a = F.linear(x, self.A.to(x.dtype))
        if self.sp:
            a = reduce_scatter_to_sequence_parallel_region(a, group=self.group)
        elif self.tp > 1:
            a = reduce_from_tensor_model_parallel_region(a, group=self.group)
        return F.linear(a, self.B.to(a.dtype)) * self.scale


def is_adapter(name: str) -> bool:
    """Whether a GPTModel parameter name is an adapter's (the bridge maps the others)."""
    return ADAPTER in name


def attach(gpt: nn.Module, hf_config, spec: Spec) -> dict[str, Adapter]:
    """Freeze every GPTModel parameter and hang an adapter on each targeted linear of this
    rank's layers (zeros: `load` fills them); returns them by module name."""
    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:  # rule lora-megatron-targets refuses these before any weights load
        raise RuntimeError(f"no Megatron linear for LoRA targets {unknown}")
    for p in gpt.parameters():
        p.requires_grad_(False)
    nh, ng, hd = hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config)
    wanted: dict[tuple[str, str], list[str]] = {}
    for t in spec.targets:
        owner, linear, piece = TARGETS[t]
        wanted.setdefault((owner, linear), []).append(piece)
    out = {}
    for j, layer in enumerate(gpt.decoder.layers):
        for (owner, linear), pieces in wanted.items():
            mod = getattr(layer, owner)
            base = getattr(mod, linear)
            if linear == "linear_qkv":
                groups = ng // base.tp_group.size()
                rows = {"q": groups * nh // ng * hd, "k": groups * hd, "v": groups * hd}
                ad = ColumnLoRA(base, rows, pieces, spec.r, spec.scale, groups)
            elif linear == "linear_fc1":
                f = base.output_size_per_partition // 2
                ad = ColumnLoRA(base, {"gate": f, "up": f}, pieces, spec.r, spec.scale)
            else:
                ad = RowLoRA(base, spec.r, spec.scale)
            if not hasattr(mod, "lora"):
                mod.lora = nn.ModuleDict()
            mod.lora[linear] = ad
            out[f"decoder.layers.{j}.{owner}.lora.{linear}"] = ad
    return out


def key_of(name: str, hf_config, lay: ShardLayout) -> tuple[str, int | None]:
    """(PEFT key, split dim or None) of an adapter parameter of a rank at layout `lay`, e.g.
    decoder.layers.1.self_attention.lora.linear_qkv.B.q -> (model.layers.<i>.self_attn.q_proj.lora_B, 0);
    keys name PEFT's tensors by module (`peft_tensors`)."""
    parts = name.split(".")
    j, owner, linear, which = int(parts[2]), parts[3], parts[5], parts[6]
    piece = parts[7] if len(parts) > 7 else None
    proj = next(hf for hf, t in TARGETS.items() if t == (owner, linear, piece))
    layer = stage_layers(hf_config.num_hidden_layers, lay.pp, lay.pp_rank)[j]
    column = linear in FUSED
    dim = (0 if column else None) if which == "B" else (None if column else 1)
    return f"model.layers.{layer}.{HF_OWNER[owner]}.{proj}.lora_{which}", dim


def _links(gpt: nn.Module, hf_config, lay: ShardLayout):
    """(PEFT key, split dim or None, parameter) for every adapter tensor of this rank."""
    for name, p in gpt.named_parameters():
        if is_adapter(name):
            yield (*key_of(name.removeprefix("module."), hf_config, lay), p)


def peft_tensors(peft_model) -> dict[str, torch.Tensor]:
    """PEFT's adapter weights by `key_of` key (from the HF model the runner built)."""
    name = peft_model.active_adapter
    out = {}
    for path, mod in peft_model.get_base_model().named_modules():
        if hasattr(mod, "lora_A") and name in mod.lora_A:
            out[path + ".lora_A"] = mod.lora_A[name].weight
            out[path + ".lora_B"] = mod.lora_B[name].weight
    return out


def to_megatron(tensors: dict[str, torch.Tensor], names, hf_config, lay: ShardLayout) -> dict[str, torch.Tensor]:
    """This rank's shards, by adapter parameter name, of whole PEFT-keyed tensors (weights, or
    anything laid out like them: Adam moments)."""
    out = {}
    for name in names:
        key, dim = key_of(name, hf_config, lay)
        t = tensors[key]
        out[name] = t.clone() if dim is None else t.chunk(lay.tp, dim)[lay.tp_rank].clone()
    return out


def load(gpt: nn.Module, tensors: dict[str, torch.Tensor], hf_config, lay: ShardLayout) -> None:
    """Fill this rank's adapter shards from whole PEFT tensors (`peft_tensors` keys)."""
    with torch.no_grad():
        for key, dim, p in _links(gpt, hf_config, lay):
            t = tensors[key]
            p.copy_(t if dim is None else t.chunk(lay.tp, dim)[lay.tp_rank])


def pieces(pairs, hf_config, lay: ShardLayout) -> list:
    """(PEFT key, order key, concat dim, tensor) of (adapter name, tensor) pairs of a rank at `lay`."""
    out = []
    for name, t in pairs:
        key, dim = key_of(name, hf_config, lay)
        out.append((key, () if dim is None else (lay.tp_rank,), dim or 0, t.detach().to("cpu", copy=True)))
    return out


def assemble(everyone: list) -> dict[str, torch.Tensor]:
    """Whole PEFT tensors from the `pieces` of every rank (of one layout)."""
    parts: dict[str, dict] = {}
    for rank_parts in everyone:
        for key, order, dim, t in rank_parts:
            parts.setdefault(key, {}).setdefault(order, (dim, t))  # data-parallel copies: keep one
    return {k: torch.cat([v[o][1] for o in sorted(v)], dim=next(iter(v.values()))[0]) for k, v in parts.items()}


def to_hf(gpt: nn.Module, hf_config, lay: ShardLayout) -> dict[str, torch.Tensor]:
    """Every adapter tensor in PEFT's whole shape, gathered onto every rank (collective)."""
    mine = pieces(((n.removeprefix("module."), p) for n, p in gpt.named_parameters() if is_adapter(n)),
                  hf_config, lay)
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # in-process tensors, never from files
    return assemble(everyone)


def set_enabled(gpt: nn.Module, on: bool) -> None:
    for m in gpt.modules():
        if isinstance(m, Adapter):
            m.enabled = on


@contextlib.contextmanager
def disabled(gpt: nn.Module):
    """The adapter-free base model while active (a reference model that costs no memory)."""
    set_enabled(gpt, False)
    try:
        yield
    finally:
        set_enabled(gpt, True)


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """An HF (PEFT) model's base weights under plain HF names, adapters left out (not merged)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {k.replace(".base_layer.", "."): v.detach() for k, v in base.state_dict().items() if "lora_" not in k}
