"""backend=megatron's checkpoint state in the canonical format (workbench/checkpoints/canonical.py):
what a rank writes and how it fills itself from whatever layout wrote the checkpoint.

    flat = canonical_state(backend)      # {"model/<HF name>": tensor or DTensor, "optim/<HF name>/<state>": ...}
    load_canonical(backend, read)        # read(want) fills whole HF tensors; this rank cuts its shards

Base weights and their Adam moments: each TP block is a rectangular block of the HF tensor (the
bridge's `pieces`), written as a DTensor shard over the TP group; replicated tensors (norms, a
reward model's scalar head) are plain tensors, PP stages write their own keys, MoE experts are
gathered first. LoRA adapters and their moments (small) are gathered whole under the names PEFT
writes, so backend=single reads them as its own. With the distributed optimizer its fp32 main
weights are what is written. Reading, every rank asks for the whole HF tensors of its stage and
cuts its shards (`bridge.to_megatron`, `lora.to_megatron`; the mapping is elementwise, so a
moment goes where its weight goes). Functions of the backend (`b`), which holds the model,
optimizer and layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workbench.checkpoints import canonical
from workbench.core.errors import UserError
from workbench.megatron import bridge, lora


def trainable(b) -> dict[str, nn.Parameter]:
    return {n: p for n, p in b.gpt.named_parameters() if p.requires_grad}

def optimizer_state(b) -> tuple[int, dict, dict]:
    """(step, {moment: {name: tensor}}, {name: fp32 main weight} (distributed optimizer only))."""
    if b.mopt is not None:
        return b.mopt.full_state()
    names = {p: n for n, p in trainable(b).items()}
    st = {names[p]: s for p, s in b.optimizer.state.items() if s}
    step = int(next(iter(st.values()))["step"]) if st and "step" in next(iter(st.values())) else 0
    moments = {k: {n: s[k] for n, s in st.items() if k in s} for k in MOMENTS}
    return step, {k: v for k, v in moments.items() if v}, {}

def kinds(b) -> tuple[str, ...]:
    """The optimizer state a checkpoint carries: Adam's moments (Megatron's optimizer is Adam)."""
    if b.mopt is not None or isinstance(b.optimizer, torch.optim.Adam | torch.optim.AdamW):
        return MOMENTS
    return ()

def head_name(b) -> str:
    """The canonical name of the reward head: `lm_head.weight`, or under adapters PEFT's name
    for it, as backend=single writes it."""
    if not b.adapter:
        return "lm_head.weight"
    return next(canonical.canonical_name(n) for n, p in b.train_module.named_parameters()
                if p.requires_grad and "lora_" not in n)

def base_pieces(b, pairs, prefix: str) -> dict:
    """{prefix + HF name: this rank's block} for (Megatron name, tensor) pairs of base weights:
    a DTensor shard over the TP group where the bridge splits the tensor, a plain tensor where it
    is replicated (DCP writes one copy). Vocabulary rows lose the TP padding (an uneven last shard)."""
    out, experts = {}, []
    vocab = b.hf_config.vocab_size
    for name, key, dim, t in bridge.pieces(pairs, b.hf_config, b.layout):
        if "#expert." in name:
            experts.append((name, key, dim, t))
        elif key == ():  # norms, a reward model's scalar head
            out[prefix + (head_name(b) if name == "lm_head.weight" else name)] = t
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo = b.layout.tp_rank * t.shape[0]
            out[prefix + name] = tp_shard(b, t[:max(0, min(t.shape[0], vocab - lo))], 0, vocab)
        else:
            out[prefix + name] = tp_shard(b, t, dim, t.shape[dim] * b.layout.tp)
    if experts:  # a rank holds two row blocks of the fused gate_up tensor: gather, write whole
        out.update({prefix + k: v for k, v in gathered_experts(b, experts).items()})
    return out

def adapter_pieces(b, pairs, prefix: str) -> dict:
    """Whole PEFT tensors of the adapters in (adapter parameter name, tensor) pairs, gathered
    over every rank (adapters are small); every rank writes them alike, DCP keeps one copy."""
    mine = lora.pieces(pairs, b.hf_config, b.layout)
    everyone = [mine]
    if dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)  # in-process tensors, never from files
    return {prefix + peft_name(k): v for k, v in lora.assemble(everyone).items()}

def pieces(b, tensors: dict, prefix: str) -> dict:
    base = [(n, t) for n, t in tensors.items() if not lora.is_adapter(n)]
    out = base_pieces(b, base, prefix) if base else {}
    if b.adapter:  # collective: every rank joins
        out.update(adapter_pieces(b, [(n, t) for n, t in tensors.items() if lora.is_adapter(n)], prefix))
    return out

def tp_shard(b, t: torch.Tensor, dim: int, full: int):
    if b.layout.tp == 1:
        return t
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if b._tp_mesh is None:  # the run's device type: its process groups' backend expects it
        b._tp_mesh = DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), b.device)
    shape = list(t.shape)
    shape[dim] = full
    size = torch.Size(shape)
    return DTensor.from_local(t.to(b.device).contiguous(), b._tp_mesh, [Shard(dim)], shape=size,
                              stride=torch.empty(size, device="meta").stride())

def gathered_experts(b, experts: list) -> dict:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, experts)  # in-process tensors, never from files
    by_name: dict = {}
    for part in everyone:
        for name, key, dim, t in part:
            by_name.setdefault(name, {}).setdefault(key, (dim, t))
    out: dict = {}
    bridge._assemble_experts(by_name, out)
    return out

def canonical_state(b) -> dict:
    step, moments, masters = optimizer_state(b)
    weights = {n: masters.get(n, p.detach()) for n, p in trainable(b).items()}
    flat = pieces(b, weights, "model/")
    for kind in kinds(b):
        if kind in moments:
            flat.update({f"{k}/{kind}": v for k, v in pieces(b, moments[kind], "optim/").items()})
    if moments:
        for k in [k for k in flat if k.startswith("model/")]:
            flat[f"optim/{k[6:]}/step"] = torch.tensor(float(step))
    return flat

def stage_names(b) -> dict[str, torch.Size]:
    """HF names (and full shapes) of what this rank's PP stage holds (full fine-tuning)."""
    cfg, lay = b.hf_config, b.layout
    layers = {f"model.layers.{i}." for i in bridge.stage_layers(cfg.num_hidden_layers, lay.pp, lay.pp_rank)}
    first, last = lay.pp_rank == 0, lay.pp_rank == lay.pp - 1
    out = {}
    for k, v in b.hf.state_dict().items():
        if k == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # the tied head is the embedding
        if (any(k.startswith(x) for x in layers) or (k == "model.embed_tokens.weight"
                                                      and (first or (last and cfg.tie_word_embeddings)))
                or (last and k in ("model.norm.weight", "lm_head.weight"))):
            out[k] = v.shape
    return out

def load_canonical(b, read) -> None:
    params = trainable(b)
    base = [n for n in params if not lora.is_adapter(n)]
    adapters = [n for n in params if lora.is_adapter(n)]
    wanted = kinds(b)
    shapes: dict[str, torch.Size] = {}
    if base and not b.adapter:
        shapes.update(stage_names(b))
    elif base:  # an adapter run's reward head
        shapes[head_name(b)] = b.gpt.output_layer.weight.shape
    peft = {}  # PEFT module key (lora.key_of) -> canonical name
    if adapters:
        whole = lora.peft_tensors(b.train_module.inner)
        for n in adapters:
            key, _ = lora.key_of(n, b.hf_config, b.layout)
            peft[key] = peft_name(key)
            shapes[peft[key]] = whole[key].shape
    want = {}
    for k, shape in shapes.items():
        want[f"model/{k}"] = torch.empty(shape)
        for kind in wanted:
            want[f"optim/{k}/{kind}"] = torch.empty(shape)
        if wanted:
            want[f"optim/{k}/step"] = torch.tensor(0.0)
    read(want)
    local: dict[str, dict] = {}
    for what in ("model", *wanted):
        key = (lambda k: f"model/{k}") if what == "model" else (lambda k, w=what: f"optim/{k}/{w}")
        got: dict = {}
        if base and not b.adapter:
            mapped = bridge.to_megatron({k: want[key(k)] for k in stage_names(b)}, b.hf_config,
                                        b.layout)
            missing = [n for n in base if n not in mapped]
            if missing:
                raise RuntimeError(f"megatron: no HF tensor for {missing} in the checkpoint's mapping")
            got.update({n: mapped[n] for n in base})
        elif base:
            got["output_layer.weight"] = want[key(head_name(b))]
        if adapters:
            got.update(lora.to_megatron({k: want[key(v)] for k, v in peft.items()}, adapters, b.hf_config,
                                        b.layout))
        local[what] = got
    step = int(float(want[f"optim/{next(iter(shapes))}/step"])) if wanted and shapes else 0
    model = local.pop("model")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(model[n].reshape(p.shape))
    if b.mopt is not None:
        b.mopt.load_full_state(step, local, model)
    elif local:
        for n, p in params.items():
            b.optimizer.state[p] = {"step": torch.tensor(float(step)),
                                       **{k: v[n].to(p).reshape(p.shape).clone() for k, v in local.items()}}

def layout_record(b) -> dict:
    lay = b.layout
    return {"tp": lay.tp, "tp_rank": lay.tp_rank, "pp": lay.pp, "pp_rank": lay.pp_rank, "ep": lay.ep,
            "ep_rank": lay.ep_rank}

def load_legacy(b, path, rank: int) -> None:
    """model{.rankN}.safetensors + optim{.rankN}.pt: this rank's Megatron-Core shard, same layout
    (the format before the canonical one: full fine-tuning with a torch optimizer only)."""
    from safetensors.torch import load_file


    sfx = "" if rank == 0 else f".rank{rank}"
    state = torch.load(path / f"optim{sfx}.pt", weights_only=True)
    saved, mine = state.get("layout", {}), layout_record(b)
    if any(saved.get(k) != v for k, v in mine.items()) or b.mopt is not None or b.adapter:
        raise UserError(f"{path}: written with the Megatron layout {saved} and a torch optimizer; resume "
                        f"it once with that layout, peft=none and backend.distributed_optimizer=false to "
                        "convert it to the canonical format")
    bridge.load_into(b.gpt, load_file(path / f"model{sfx}.safetensors"))
    b.optimizer.load_state_dict(state["optimizer"])
    b.scheduler.load_state_dict(state["scheduler"])
    b.steps = int(state.get("steps", 0))


MOMENTS = ("exp_avg", "exp_avg_sq")


def peft_name(key: str) -> str:
    """The name PEFT saves an adapter tensor under, from its module key (lora.key_of):
    model.layers.0.self_attn.q_proj.lora_A -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight."""
    return f"base_model.model.{key}.weight"
