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
Checkpoints: the workbench format, one file per rank (`sharded=True`) holding its Megatron-Core
shard, with the TP/PP/EP layout recorded; resuming needs the same layout.
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
from workbench.core.errors import UserError
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
    sharded = True

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx

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
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region as gather

        from workbench.megatron.cpu_shim import cpu_device

        self.gpt.train()
        denom = self._sum(batch.denom, self.dp_group)
        scale = 1.0 / max(denom, 1e-12)
        micro = list(batch.micro)
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

        def forward_step(data_iterator, model):
            m = next(data_iterator)
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
               forward_only=False)
        self._reduce_grads(ps)
        # Only the last PP stage computed the loss: it names the sums, every stage joins the
        # reductions (zeros elsewhere), then data-parallel ranks' sums are added.
        names = [sorted(sums)]
        pp_group = ps.get_pipeline_model_parallel_group()
        if self.par.pp > 1:
            dist.broadcast_object_list(names, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        out = {k: self._sum(self._sum(sums.get(k, 0.0), pp_group), self.dp_group) for k in names[0]}
        loss = out.pop("loss_sum") / max(denom, 1e-12)
        return {"loss": loss, **out}

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

    # -- state ---------------------------------------------------------------------------
    def _layout_record(self) -> dict:
        lay = self.layout
        return {"tp": lay.tp, "tp_rank": lay.tp_rank, "pp": lay.pp, "pp_rank": lay.pp_rank, "ep": lay.ep,
                "ep_rank": lay.ep_rank, "format": "megatron-core local spec, this rank's shard"}

    def state_dict(self) -> dict:
        return {
            "sharded": True,
            "model": {n: p.detach() for n, p in self.gpt.named_parameters()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "layout": self._layout_record(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        from workbench.megatron import bridge

        saved, mine = state.get("layout", {}), self._layout_record()
        diff = {k: (saved.get(k), mine[k]) for k in ("tp", "pp", "ep", "tp_rank", "pp_rank", "ep_rank")
                if saved.get(k) != mine[k]}
        if diff:
            raise UserError(f"checkpoint was written with a different Megatron layout {diff} (saved, now); "
                            "resume with the same backend.tp/pp/ep")
        bridge.load_into(self.gpt, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))


def build(cfg, ctx) -> MegatronBackend:
    from workbench.megatron.model import require_megatron

    require_megatron()
    return MegatronBackend(cfg, ctx)
