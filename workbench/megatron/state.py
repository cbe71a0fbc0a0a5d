"""backend=megatron's checkpoint: this rank's trainable state by Megatron parameter name, read
back at the layout that wrote it or, through the bridge, at another one.

    record = layout_record(layout)                       # written beside the tensors
    saved = read(path, rank, layout, hf_config, names)   # {"model", "step", "moments", ...} for this rank

A step directory holds, per rank, `model.rank<r>.safetensors` (the trainable parameters this rank
holds: its TP shard of its PP stage; the fp32 main weights where the distributed optimizer keeps
them) and `optim.rank<r>.pt` (the optimizer step, the Adam moments under the same names, the
schedule, the layout record). At the same layout each rank reads its own files. At another one
(a tp=2, pp=2 run resumed at tp=1, pp=4 or tp=4), every rank reads every rank's files, maps
weights and moments alike to whole Hugging Face tensors (bridge.pieces / assemble; adapters by
PEFT key, workbench/megatron/lora.py: the mapping is elementwise, so a moment goes where its
weight goes) and cuts out its own shards (bridge.to_megatron, lora.to_megatron). The data
position, RNG and schedule do not depend on the layout.

This is the per-rank format the workbench's runner writes for sharded backends, with a reader
that reshards; the canonical checkpoint (Hugging Face names through DCP, every backend) will
replace it and call the same mappings (and DistributedOptimizer.full_state / load_full_state).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file

from workbench.megatron import bridge, lora

MOMENTS = ("exp_avg", "exp_avg_sq")


def layout_record(lay: bridge.Layout) -> dict:
    return asdict(lay)


def _suffix(rank: int) -> str:
    return "" if rank == 0 else f".rank{rank}"


def _rank_files(path: Path) -> list[tuple[dict, dict]]:
    """(optim.pt contents, model tensors) of every rank that wrote `path`."""
    ranks = sorted(int(p.name[len("optim.rank"):-3]) if p.name != "optim.pt" else 0
                   for p in path.glob("optim*.pt"))
    return [(torch.load(path / f"optim{_suffix(r)}.pt", weights_only=True),
             load_file(path / f"model{_suffix(r)}.safetensors")) for r in ranks]


def read(path: Path, rank: int, lay: bridge.Layout, hf_config, names: list[str]) -> dict:
    """This rank's `names` (trainable Megatron parameters) and their optimizer state from the
    checkpoint at `path`: {"model": {name: t}, "step": int, "moments": {kind: {name: t}},
    "scheduler": ..., "steps": int}."""
    own = torch.load(path / f"optim{_suffix(rank)}.pt", weights_only=True)
    opt = own["optimizer"]
    if own["layout"] == layout_record(lay):
        model = load_file(path / f"model{_suffix(rank)}.safetensors")
        return {**own, "model": model, "step": opt["step"], "moments": {k: opt[k] for k in MOMENTS if k in opt}}
    everyone = _rank_files(path)
    kinds = {"model": [(rec["layout"], tensors) for rec, tensors in everyone]}
    for k in MOMENTS:
        if k in opt:
            kinds[k] = [(rec["layout"], rec["optimizer"][k]) for rec, _ in everyone]
    local = {kind: _reshard(per_rank, hf_config, lay, names) for kind, per_rank in kinds.items()}
    return {**own, "model": local.pop("model"), "step": opt["step"], "moments": local}


def _reshard(per_rank: list[tuple[dict, dict]], hf_config, lay: bridge.Layout, names: list[str]) -> dict:
    """Whole HF tensors from every saved rank's (layout, {name: tensor}), cut for `lay`."""
    base, adapters = [], []
    for record, tensors in per_rank:
        saved = bridge.Layout(**record)
        base.append(bridge.pieces([(n, t) for n, t in tensors.items() if not lora.is_adapter(n)], hf_config, saved))
        adapters.append(lora.pieces([(n, t) for n, t in tensors.items() if lora.is_adapter(n)], hf_config, saved))
    out = lora.to_megatron(lora.assemble(adapters), [n for n in names if lora.is_adapter(n)], hf_config, lay)
    rest = [n for n in names if not lora.is_adapter(n)]
    if not rest:
        return out
    whole = bridge.assemble(base, hf_config)
    head = whole.get("lm_head.weight")
    if rest == ["output_layer.weight"] and head is not None and head.shape[0] == 1:
        return {**out, "output_layer.weight": head.clone()}  # an adapter run's reward head
    mine = bridge.to_megatron(whole, hf_config, lay)
    return {**out, **{n: mine[n] for n in rest}}
