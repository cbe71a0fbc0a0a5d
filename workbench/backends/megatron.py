"""backend=megatron: train on a Megatron-Core GPTModel (TP, PP, EP, SP, recompute) behind the runner.

    python -m workbench backend=megatron backend.tp=2 hardware.procs=2 peft=none
    torchrun --nproc_per_node=2 -m workbench backend=megatron backend.pp=2 peft=none

`wrap()` builds this rank's GPTModel shard from the HF model the runner loaded (bridge in
workbench/megatron/bridge.py) and hands methods `MegatronLM`, a module with SelectiveLM's
forward(input_ids, attention_mask, position_ids, select) returning logits at `select`
gathered over TP, so SFT and DPO run unchanged. `forward_backward` runs Megatron-Core's own
schedule (`get_forward_backward_func`): with PP=1 each micro-batch's forward step is the
method's loss; with PP>1 the last stage hands the method a view of the stage's logits (the
method must call the model once per micro-batch). Gradients are then summed over data-parallel
ranks, sequence-parallel norms over TP and tied embeddings between first and last stage.

Data: a rank's *data-parallel* rank and size decide its slice of the global batch (TP and PP
peers train on the same examples); the resolved run's layout (workbench/config/resolved.py) holds them
and `wrap()` checks that Megatron-Core's process groups agree.
Checkpoints: the canonical format (workbench/train/canonical.py) under Hugging Face names, so
any layout reads them. Writing gathers nothing: each TP block of a weight or an Adam moment is
a rectangular block of the HF tensor (the bridge's `pieces`), written as a DTensor shard over
the TP group; replicated norms are plain tensors, PP stages write their own keys. Reading, every
rank reads the full HF tensors of its stage and bridges weights and moments alike
(`to_megatron`). MoE experts are gathered over the ranks before writing.
`unwrapped()` is the HF model with the current weights bridged back (refreshed after the last
step, at eval steps and, for GRPO's rollouts, after every step; on one process also on demand).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from workbench.backends.base import Backend
from workbench.backends.step import forward_only
from workbench.core.errors import UserError
from workbench.train import canonical
from workbench.train import precision as prec
from workbench.train.batch import StepBatch
from workbench.train.distributed import ensure_process_group
from workbench.train.optim import build_optimizer, build_scheduler


@dataclass
class Config:
    name: str = "megatron"
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    recompute: str = "none"  # none | selective | full
    fp8: str | None = None  # e4m3 | hybrid: Transformer Engine on a GPU


def parallel(cfg):
    from workbench.megatron.model import Parallel

    return Parallel(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel,
                    recompute=cfg.recompute)


def check(cfg, hf_config, world_size: int) -> None:
    """The loaded model against the parallel sizes (its config.json is the truth: a hub model's
    intermediate size is not in model.arch). Combinations of options are rules (workbench/config/rules.py)."""
    from workbench.megatron.model import check_parallel, require_megatron

    require_megatron()
    check_parallel(hf_config, parallel(cfg), world_size)


class MegatronLM(nn.Module):
    """SelectiveLM's forward on a Megatron-Core GPTModel (PP=1): logits at `select`, full vocabulary."""

    def __init__(self, gpt: nn.Module, vocab: int):
        super().__init__()
        self.gpt = gpt
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None):
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = stage_forward(self.gpt, input_ids, attention_mask, position_ids)
        return gather_logits(logits, select, self.vocab, gather_from_tensor_model_parallel_region)


def stage_forward(gpt, input_ids, attention_mask, position_ids):
    """One PP stage's output: hidden states [s,b,h], or logits [b,s,V/tp] on the last stage."""
    from workbench.megatron.attention import attention_mask as build_mask
    from workbench.megatron.cpu_shim import cpu_device

    b, s = input_ids.shape
    arange = torch.arange(s, device=input_ids.device).expand(b, s)
    if position_ids is not None and not torch.equal(position_ids, arange):
        raise RuntimeError("backend=megatron applies RoPE at positions 0..T-1; packed position_ids are not supported")
    with cpu_device():
        return gpt(input_ids, arange, build_mask(attention_mask, s, b, input_ids.device))


def gather_logits(logits, select, vocab, gather):
    if select is not None:
        logits = logits[select]
    return gather(logits)[..., :vocab]


class _LogitsView(nn.Module):
    """What the method sees on the last PP stage: the logits the schedule already computed."""

    def __init__(self, logits, micro, vocab, gather):
        super().__init__()
        self.logits, self.micro, self.vocab, self.gather = logits, micro, vocab, gather
        self.used = False

    def forward(self, input_ids, attention_mask=None, position_ids=None, select=None):
        if self.used or input_ids is not self.micro["input_ids"]:
            raise RuntimeError("with backend.pp > 1 a method's loss must call the model once, on micro['input_ids']")
        self.used = True
        return gather_logits(self.logits, select, self.vocab, self.gather)


def _pad_micro(micro: dict, length: int) -> dict:
    """Right-pad every [B, T] tensor to `length` (pads never attend into real tokens, never selected)."""
    ids = micro["input_ids"]
    b, t = ids.shape
    if t == length:
        return micro
    out = dict(micro)
    for k, v in micro.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == (b, t):
            fill = -100 if k == "labels" else 0
            pad = v.new_full((b, length - t, *v.shape[2:]), fill)
            out[k] = torch.cat([v, pad], dim=1)
    return out


class MegatronBackend(Backend):
    name = "megatron"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self._tp_mesh = None  # the TP group as a device mesh, for checkpoint shards

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, train_module: nn.Module, ctx) -> None:
        from megatron.core import parallel_state as ps

        from workbench.megatron import bridge
        from workbench.megatron.model import build_gpt
        from workbench.peft.lora import base_model

        self.train_module = train_module
        self.hf = base_model(train_module.inner)
        self.hf_config = self.hf.config
        ensure_process_group(ctx.device)
        world = dist.get_world_size()
        check(self.cfg, self.hf_config, world)
        self.par = parallel(self.cfg)
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=self.par.tp,
                                         pipeline_model_parallel_size=self.par.pp,
                                         context_parallel_size=self.par.cp,
                                         expert_model_parallel_size=self.par.ep)
        self.layout = bridge.rank_layout()
        if ctx.device == "cuda":  # Megatron's dropout / recompute RNG streams live on the GPU
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(ctx.cfg.train.seed)
        self.pol = ctx.run.precision
        self.device = ctx.device
        self.gpt = build_gpt(self.hf_config, self.par, self.pol.trainable_dtype)
        if ctx.device == "cuda":
            self.gpt.cuda()
        bridge.load_into(self.gpt, bridge.to_megatron(bridge.merged_hf_state(train_module.inner),
                                                      self.hf_config, self.layout))
        self.module = MegatronLM(self.gpt, self.hf_config.vocab_size)
        self.dp_group = ps.get_data_parallel_group()
        self.dp = dist.get_world_size(self.dp_group)
        # Data-parallel rank decides the slice of the global batch; TP/PP peers share it. Methods
        # read it from the resolved layout, which must be Megatron-Core's own rank order.
        lay = ctx.run.layout
        if (ps.get_data_parallel_rank(), self.dp) != (lay.dp_rank, lay.dp):
            raise RuntimeError(f"megatron: data-parallel rank/size {ps.get_data_parallel_rank()}/{self.dp} differ from "
                               f"the resolved layout's {lay.dp_rank}/{lay.dp}")
        self.optimizer = build_optimizer(self.gpt.parameters(), ctx.cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, ctx.cfg.optim, ctx.cfg.train.max_steps)
        self.max_grad_norm = ctx.cfg.optim.max_grad_norm
        self.steps = 0

    def unwrapped(self) -> nn.Module:
        if dist.get_world_size() == 1:
            self._sync_hf()
        return self.train_module

    def generation(self):
        return contextlib.nullcontext((self.unwrapped().inner, False))  # the bridged HF copy

    def _sync_hf(self) -> None:
        """Bridge the current Megatron weights back into the HF model (collective over all ranks)."""
        from workbench.megatron import bridge

        state = bridge.to_hf(self.gpt, self.hf_config, self.layout)
        target = self.hf.state_dict()
        with torch.no_grad():
            for k, v in state.items():
                if k in target:
                    target[k].copy_(v)

    # -- step ----------------------------------------------------------------------------
    def _sum(self, value: float, group) -> float:
        if dist.get_world_size(group) == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, group=group)
        return float(t.item())

    def forward_backward(self, batch: StepBatch, loss_fn) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        denom = self._sum(batch.denom, self.dp_group)
        sums = self._schedule(list(batch.micro), loss_fn, 1.0 / max(denom, 1e-12), forward_only=False,
                              seeds=batch.micro_seeds)
        self._reduce_grads(ps)
        out = {k: self._sum(v, self.dp_group) for k, v in sums.items()}
        loss = out.pop("loss_sum") / max(denom, 1e-12)
        return {"loss": loss, **out}

    def forward_only(self, micro: dict, loss_fn) -> float:
        if self.par.pp == 1:
            from workbench.megatron.cpu_shim import cpu_device

            with cpu_device():  # the TP gather of the logits asks torch.cuda for a device
                return forward_only(self.module, micro, loss_fn, self.pol, self.device)
        self.gpt.eval()
        try:
            with torch.no_grad():
                return self._schedule([micro], loss_fn, 1.0, forward_only=True)["loss_sum"]
        finally:
            self.gpt.train()

    def _schedule(self, micro: list, loss_fn, scale: float, forward_only: bool, seeds=None) -> dict[str, float]:
        """Megatron-Core's schedule over `micro`; the method's summed metrics, summed over PP stages
        (only the last stage computes the loss: it names the sums, every stage joins)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

        from workbench.megatron.cpu_shim import cpu_device

        if not forward_only:
            self.gpt.train()
        length = max(m["input_ids"].shape[1] for m in micro)
        if self.par.sequence_parallel:
            length = -(-length // self.par.tp) * self.par.tp
        if self.par.pp > 1 or self.par.sequence_parallel:
            micro = [_pad_micro(m, length) for m in micro]
        sums: dict[str, float] = {}
        vocab = self.hf_config.vocab_size

        def loss_func(m, output):
            if self.par.pp == 1:
                loss_sum, metrics = output
            else:
                loss_sum, metrics = loss_fn(_LogitsView(output, m, vocab, gather), m)
            for k, v in {"loss_sum": float(loss_sum.detach()), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            return loss_sum.float() * scale, torch.tensor(1, dtype=torch.int), {}

        order = iter(seeds or [])

        def forward_step(data_iterator, model):
            m = next(data_iterator)
            seed = next(order, None)
            if seed is not None:
                torch.manual_seed(seed)  # layout-free dropout (workbench/train/noise.py)
            with prec.autocast(self.pol, self.device):
                if self.par.pp == 1:
                    loss_sum, metrics = loss_fn(self.module, m)
                    out = loss_sum.reshape(())
                    return out, lambda o: loss_func(m, (o, metrics))
                out = stage_forward(model, m["input_ids"], m.get("attention_mask"), None)
            return out, lambda o: loss_func(m, o)

        fb = get_forward_backward_func()
        with cpu_device():
            fb(forward_step_func=forward_step, data_iterator=iter(micro), model=[self.gpt],
               num_microbatches=len(micro), seq_length=length, micro_batch_size=micro[0]["input_ids"].shape[0],
               forward_only=forward_only)
        names = [sorted(sums)]
        pp_group = ps.get_pipeline_model_parallel_group()
        if self.par.pp > 1:
            dist.broadcast_object_list(names, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        return {k: self._sum(sums.get(k, 0.0), pp_group) for k in names[0]}

    def _reduce_grads(self, ps) -> None:
        params = [p for p in self.gpt.parameters() if p.requires_grad and p.grad is not None]
        if self.dp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=self.dp_group)  # losses are already / global denom
        if self.par.sequence_parallel:  # norms see only this rank's tokens under SP
            for p in params:
                if getattr(p, "sequence_parallel", False):
                    dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        if self.par.pp > 1 and self.hf_config.tie_word_embeddings and ps.is_rank_in_embedding_group():
            w = self.gpt.shared_embedding_or_output_weight()
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            dist.all_reduce(w.grad, group=ps.get_embedding_group())

    def _grad_norm(self, ps) -> torch.Tensor:
        """Global L2 norm: TP shards and PP stages summed once, replicated tensors counted once."""
        tp_rank = ps.get_tensor_model_parallel_rank()
        dense = torch.zeros((), dtype=torch.float64)
        expert = torch.zeros((), dtype=torch.float64)
        tied_copy = (self.par.pp > 1 and self.hf_config.tie_word_embeddings and ps.is_pipeline_last_stage()
                     and not ps.is_pipeline_first_stage())
        for name, p in self.gpt.named_parameters():
            if p.grad is None:
                continue
            if tied_copy and name == "output_layer.weight":
                continue  # the same tensor as the first stage's embedding
            if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if getattr(p, "allreduce", True):
                dense += sq
            else:
                expert += sq
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        if self.par.ep > 1 or any(not getattr(p, "allreduce", True) for p in self.gpt.parameters()):
            dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return (dense + expert).sqrt()

    def optimizer_step(self) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        gn = self._grad_norm(ps)
        if self.max_grad_norm > 0:
            coef = torch.clamp(self.max_grad_norm / (gn + 1e-6), max=1.0)
            for p in self.gpt.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef.to(p.grad.dtype))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        t = self.ctx.cfg
        # GRPO generates with unwrapped() every step, so it needs the bridge back every step.
        if (self.steps >= t.train.max_steps or t.method.name == "grpo"
                or (t.eval.every_n_steps and self.steps % t.eval.every_n_steps == 0)):
            self._sync_hf()  # export and eval read the HF model; every rank joins the gather
        return {"grad_norm": float(gn), "lr": lr}

    # -- state (workbench/train/canonical.py) ----------------------------------------------------
    def _canonical_pieces(self, pairs, prefix: str) -> dict:
        """{prefix + HF name: this rank's block} for (Megatron name, tensor) pairs: a DTensor shard
        over the TP group where the bridge splits the tensor, a plain tensor where it is replicated
        (DCP writes one copy). Vocabulary rows lose the TP padding (an uneven last shard)."""
        from workbench.megatron import bridge

        out, experts = {}, []
        vocab = self.hf_config.vocab_size
        for name, key, dim, t in bridge.pieces(pairs, self.hf_config, self.layout):
            if "#expert." in name:
                experts.append((name, key, dim, t))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                lo = self.layout.tp_rank * t.shape[0]
                out[prefix + name] = self._tp_shard(t[:max(0, min(t.shape[0], vocab - lo))], 0, vocab)
            elif key == ():
                out[prefix + name] = t
            else:
                out[prefix + name] = self._tp_shard(t, dim, t.shape[dim] * self.layout.tp)
        if experts:  # a rank holds two row blocks of the fused gate_up tensor: gather, write whole
            out.update({prefix + k: v for k, v in self._gathered_experts(experts).items()})
        return out

    def _tp_shard(self, t: torch.Tensor, dim: int, full: int):
        if self.layout.tp == 1:
            return t
        from megatron.core import parallel_state as ps
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        if self._tp_mesh is None:  # the run's device type: its process groups' backend expects it
            self._tp_mesh = DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), self.device)
        shape = list(t.shape)
        shape[dim] = full
        size = torch.Size(shape)
        return DTensor.from_local(t.to(self.device).contiguous(), self._tp_mesh, [Shard(dim)], shape=size,
                                  stride=torch.empty(size, device="meta").stride())

    def _gathered_experts(self, experts: list) -> dict:
        from workbench.megatron import bridge

        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, experts)  # in-process tensors, never from files
        by_name: dict = {}
        for part in everyone:
            for name, key, dim, t in part:
                by_name.setdefault(name, {}).setdefault(key, (dim, t))
        out: dict = {}
        bridge._assemble_experts(by_name, out)
        return out

    def _moments(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq") if isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW) else ()

    def canonical_state(self) -> dict:
        named = [(n, p) for n, p in self.gpt.named_parameters()]
        flat = self._canonical_pieces([(n, p.detach()) for n, p in named], "model/")
        state = [self.optimizer.state.get(p, {}) for _, p in named]
        if not all(state) or not self._moments():
            return flat
        for key in self._moments():
            moments = self._canonical_pieces([(n, st[key]) for (n, _), st in zip(named, state)], "optim/")
            flat.update({f"{k}/{key}": v for k, v in moments.items()})
        step = torch.tensor(float(state[0]["step"]))
        for k in [k for k in flat if k.startswith("model/")]:
            flat[f"optim/{k[6:]}/step"] = step.clone()
        return flat

    def _stage_names(self) -> dict[str, torch.Size]:
        """HF names (and full shapes) of what this rank's PP stage holds."""
        from workbench.megatron import bridge

        cfg, lay = self.hf_config, self.layout
        layers = {f"model.layers.{i}." for i in bridge.stage_layers(cfg.num_hidden_layers, lay.pp, lay.pp_rank)}
        first, last = lay.pp_rank == 0, lay.pp_rank == lay.pp - 1
        out = {}
        for k, v in self.hf.state_dict().items():
            if k == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # the tied head is the embedding
            if (any(k.startswith(x) for x in layers) or (k == "model.embed_tokens.weight"
                                                          and (first or (last and cfg.tie_word_embeddings)))
                    or (last and k in ("model.norm.weight", "lm_head.weight"))):
                out[k] = v.shape
        return out

    def load_canonical(self, read) -> None:
        from workbench.megatron import bridge

        names, moments = self._stage_names(), self._moments()
        want = {f"model/{k}": torch.empty(s) for k, s in names.items()}
        for k, s in names.items():
            for key in moments:
                want[f"optim/{k}/{key}"] = torch.empty(s)
            if moments:
                want[f"optim/{k}/step"] = torch.tensor(0.0)
        read(want)
        dtype = next(self.gpt.parameters()).dtype
        bridge.load_into(self.gpt, {n: t.to(dtype) for n, t in bridge.to_megatron(
            {k: want[f"model/{k}"] for k in names}, self.hf_config, self.layout).items()})
        if not moments:
            return
        local = {key: bridge.to_megatron({k: want[f"optim/{k}/{key}"] for k in names}, self.hf_config, self.layout)
                 for key in moments}
        step = want[f"optim/{next(iter(names))}/step"]
        for n, p in self.gpt.named_parameters():
            st = self.optimizer.state[p]
            for key in moments:
                st[key] = local[key][n].to(p.device).clone()
            st["step"] = step.clone()

    def schedule_state(self) -> dict:
        return {**canonical.schedule_state(self.scheduler), "steps": self.steps}

    def load_schedule(self, state: dict) -> None:
        canonical.apply_schedule(self.scheduler, self.optimizer, {k: v for k, v in state.items() if k != "steps"})
        self.steps = int(state.get("steps", state["last_epoch"]))

    def _layout_record(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "tp_rank": lay.tp_rank, "pp": lay.pp, "pp_rank": lay.pp_rank, "ep": lay.ep,
                "ep_rank": lay.ep_rank}

    def load_legacy(self, path, rank: int) -> None:
        """model{.rankN}.safetensors + optim{.rankN}.pt: this rank's Megatron-Core shard, same layout."""
        from safetensors.torch import load_file

        from workbench.megatron import bridge

        sfx = "" if rank == 0 else f".rank{rank}"
        state = torch.load(path / f"optim{sfx}.pt", weights_only=True)
        saved, mine = state.get("layout", {}), self._layout_record()
        if any(saved.get(k) != v for k, v in mine.items()):
            raise UserError(f"{path}: written with the Megatron layout {saved}, this run is {mine}; resume with "
                            "that layout once (backend.tp/pp/ep) to convert it to the canonical format")
        bridge.load_into(self.gpt, load_file(path / f"model{sfx}.safetensors"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))


def build(cfg, ctx) -> MegatronBackend:
    from workbench.megatron.model import require_megatron

    require_megatron()
    return MegatronBackend(cfg, ctx)
