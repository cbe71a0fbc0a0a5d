"""backend=megatron: train on a Megatron-Core GPTModel (TP, PP, EP, SP, recompute) behind the runner.

    python -m workbench backend=megatron backend.tp=2 hardware.procs=2             # LoRA (peft=lora, the default)
    python -m workbench backend=megatron backend.tp=2 hardware.procs=2 peft=none   # full fine-tuning
    python -m workbench backend=megatron hardware.procs=2 peft=none backend.distributed_optimizer=true
    torchrun --nproc_per_node=2 -m workbench backend=megatron backend.pp=2 method=dpo

`wrap()` builds this rank's GPTModel shard from the HF model the runner loaded (bridge in
workbench/megatron/bridge.py; with peft=lora the unmerged base, then LoRA adapters on the
parallel linears initialised from the runner's PEFT adapters, workbench/megatron/lora.py; for a
reward model a scalar head on the last stage) and hands methods `MegatronLM`
(workbench/megatron/lm.py), SelectiveLM's forward on it. `forward_backward` runs Megatron-Core's
own schedule (`get_forward_backward_func`): with PP=1 each micro-batch's forward step is the
method's loss; with PP>1 the last stage hands the method a view of the stage's logits (the
method must call the model once per micro-batch).

Optimizer: a torch optimizer over this rank's trainable parameters, gradients reduced by
workbench/megatron/grads.py (data-parallel; experts over expert-data-parallel), or with
`backend.distributed_optimizer=true` Megatron-Core's DDP and distributed optimizer
(workbench/megatron/optimizer.py: state sharded over data-parallel ranks, its clipping and
mixed precision).

Data: a rank's *data-parallel* rank and size decide its slice of the global batch (TP and PP
peers train on the same examples); the resolved run's layout (workbench/resolve/resolved.py) holds them
and `wrap()` checks that Megatron-Core's process groups agree.
Checkpoints: the canonical format (workbench/checkpoints/canonical.py) under Hugging Face names, so
any layout and backend reads them: base weights by TP block, adapters whole under PEFT's names,
the distributed optimizer's fp32 main weights (workbench/backends/megatron_state.py).
`unwrapped()` is the HF model with the current weights (with LoRA: the adapters) bridged back
(refreshed after the last step, at eval steps and, for methods that generate, after every step;
on one process also on demand).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from workbench.backends import megatron_state as state
from workbench.backends.base import Backend
from workbench.backends.spec import BackendFacts, BackendSpec, BackendTerms, checkpointing, on
from workbench.backends.step import forward_only
from workbench.checkpoints import canonical
from workbench.compute import precision as prec
from workbench.compute.optim import build_optimizer, build_scheduler, lr_factor
from workbench.config import rule
from workbench.config.rule import Rule
from workbench.config.schema import pick
from workbench.families import registry as families
from workbench.megatron import bridge, grads, lora
from workbench.megatron.cpu_shim import cpu_device
from workbench.megatron.lm import LogitsView, MegatronLM, pad_micro, stage_forward
from workbench.megatron.lora import TARGETS
from workbench.megatron.model import Parallel, build_gpt, check_parallel, require_megatron
from workbench.megatron.optimizer import DistributedOptimizer
from workbench.models.build import rebuild_plain
from workbench.peft.lora import base_model
from workbench.train.batch import StepBatch
from workbench.train.distributed import all_max, ensure_process_group, reduce_scalar
from workbench.train.layout import layout


@dataclass
class Config:
    name: str = "megatron"  # the backend; backend=megatron sets it
    tp: int = 1  # tensor parallelism: ranks splitting each linear; divides the heads, KV heads and MLP width
    pp: int = 1  # pipeline parallelism: stages the layers are split into; divides the layers
    cp: int = 1  # context parallelism: ranks splitting each sequence (> 1: Transformer Engine on a GPU)
    ep: int = 1  # expert parallelism (MoE): ranks splitting the experts; divides the experts and the data-parallel size
    # with tp > 1, split the norms' and dropout's activations over the sequence across TP ranks;
    # needs Transformer Engine layer specs, which are not built yet: refused (rule megatron-sequence-parallel)
    sequence_parallel: bool = False
    # Megatron-Core's distributed optimizer: Adam state and fp32 main weights sharded over the
    # data-parallel ranks (optim.name=adamw; not with precision=fp16)
    distributed_optimizer: bool = False
    recompute: str = "none"  # activation recompute: none | selective (the attention core) | full (every layer)
    # e4m3 | hybrid: Transformer Engine fp8; refused for now (rule megatron-fp8: the backend does not
    # build Transformer Engine layer specs), so keep null
    fp8: str | None = None


def parallel(cfg):
    return Parallel(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel,
                    recompute=cfg.recompute)


def check(cfg, hf_config, world_size: int) -> None:
    """The loaded model against the parallel sizes (its config.json is the truth: a hub model's
    intermediate size is not in model.arch). Combinations of options are rules (workbench/resolve/rules.py)."""
    require_megatron()
    check_parallel(hf_config, parallel(cfg), world_size)


_GROUPS_OF: list = [None]  # the default process group Megatron-Core's groups were made in


def _init_model_parallel(par) -> None:
    """Megatron-Core's process groups for `par` (made again when a process trains another layout,
    or in another default process group: a dry_run=trace's fake one is gone after the trace)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        now = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
               ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if now == (par.tp, par.pp, par.cp, par.ep) and _GROUPS_OF[0] is dist.group.WORLD:
            return
        ps.destroy_model_parallel()
        # 0.16.1's destroy leaves this rank list behind, and initialize sets it only on the
        # embedding group's members: a middle stage would take itself for a member
        ps._EMBEDDING_GLOBAL_RANKS = None
    _GROUPS_OF[0] = dist.group.WORLD
    ps.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                 context_parallel_size=par.cp, expert_model_parallel_size=par.ep)


class MegatronBackend(Backend):
    name = "megatron"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self._tp_mesh = None  # the TP group as a device mesh, for checkpoint shards

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, train_module: nn.Module, ctx) -> None:
        from megatron.core import parallel_state as ps


        self.train_module = train_module
        inner = train_module.inner
        self.hf = base_model(inner)
        self.hf_config = self.hf.config
        ensure_process_group(ctx.device)
        check(self.cfg, self.hf_config, dist.get_world_size())
        self.par = parallel(self.cfg)
        _init_model_parallel(self.par)
        self.layout = bridge.rank_layout()
        if ctx.device == "cuda":  # Megatron's dropout / recompute RNG streams live on the GPU
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(ctx.cfg.train.seed)
        run = ctx.run
        self.pol, self.device = run.precision, ctx.device
        self.adapter, self.distopt = run.peft.adapter, bool(self.cfg.distributed_optimizer)
        self.tied = bool(self.hf_config.tie_word_embeddings)
        dtype = self._params_dtype()
        self.gpt = build_gpt(self.hf_config, self.par, dtype, scalar_head=run.facts.scalar_head,
                             compute_dtype=self.pol.compute_dtype)
        if self.adapter:
            bridge.load_into(self.gpt, bridge.to_megatron(lora.base_state(inner), self.hf_config, self.layout))
            lora.attach(self.gpt, self.hf_config, lora.spec_of(inner))
            lora.load(self.gpt, lora.peft_tensors(inner), self.hf_config, self.layout)
            if run.facts.scalar_head and self.gpt.post_process:  # the reward head trains beside the adapters
                head = self.gpt.output_layer.weight
                head.data = head.data.to(self.pol.trainable_dtype)
                head.requires_grad_(True)
        else:
            bridge.load_into(self.gpt, bridge.to_megatron(bridge.merged_hf_state(inner), self.hf_config,
                                                          self.layout))
        if not run.keeps_hf_base:
            _release_base(inner)
        if ctx.device == "cuda":
            self.gpt.cuda()
        self.dp_group = ps.get_data_parallel_group()
        self.dp = dist.get_world_size(self.dp_group)
        # Data-parallel rank decides the slice of the global batch; TP/PP peers share it. Methods
        # read it from the resolved layout, which must be Megatron-Core's own rank order.
        lay = run.layout
        if (ps.get_data_parallel_rank(), self.dp) != (lay.dp_rank, lay.dp):
            raise RuntimeError(f"megatron: data-parallel rank/size {ps.get_data_parallel_rank()}/{self.dp} differ from "
                               f"the resolved layout's {lay.dp_rank}/{lay.dp}")
        self.max_steps = ctx.cfg.train.max_steps
        self.max_grad_norm = ctx.cfg.optim.max_grad_norm
        self.optimizer = self.scheduler = self.mopt = None
        if self.distopt:
            self.mopt = DistributedOptimizer(self.gpt, ctx.cfg.optim, dtype)
            self.chunk = self.mopt.ddp
        else:
            self.chunk = self.gpt
            self.optimizer = build_optimizer(self.gpt.parameters(), ctx.cfg.optim)
            self.scheduler = build_scheduler(self.optimizer, ctx.cfg.optim, self.max_steps)
        head = "scalar" if run.facts.scalar_head else "shard" if run.facts.teacher else "gather"
        switch = next((m for m in inner.modules() if hasattr(m, "lora_A")), None) if self.adapter else None
        self.module = MegatronLM(self.chunk, self.hf_config.vocab_size, head, switch)
        self.steps = 0

    def _params_dtype(self) -> torch.dtype:
        """A LoRA base is frozen: the policy's frozen dtype. Megatron's own optimizer keeps
        half-precision parameters with fp32 main weights (its mixed precision); the torch
        optimizer trains the policy's trainable dtype under autocast."""
        if self.adapter:
            return self.pol.frozen_dtype
        if self.distopt and self.pol.autocast_dtype is not None:
            return self.pol.autocast_dtype
        return self.pol.trainable_dtype

    def unwrapped(self) -> nn.Module:
        if dist.get_world_size() == 1:
            self._sync_hf()
        return self.train_module

    def gathered_model(self) -> nn.Module | None:
        """The trained HF model for eval and export. Where the HF copy kept only its trainable
        tensors (run.keeps_hf_base), rank 0 rebuilds the base from its source on the CPU and
        takes those tensors (every rank holds them, bridged back); the other ranks get None."""
        module = self.unwrapped()
        if self.ctx.run.keeps_hf_base:
            return module.inner
        if dist.get_rank() != 0:
            return None

        trainable = {f"inner.{n}": p.detach() for n, p in module.inner.named_parameters() if p.requires_grad}
        return rebuild_plain(self.ctx.run, trainable, only=set(trainable))

    def generation(self):
        return contextlib.nullcontext((self.unwrapped().inner, False))  # the bridged HF copy

    def _sync_hf(self) -> None:
        """Bridge the current trainable weights back into the HF model (collective over all ranks)."""
        with torch.no_grad():
            if self.adapter:
                full = lora.to_hf(self.gpt, self.hf_config, self.layout)
                for key, p in lora.peft_tensors(self.train_module.inner).items():
                    p.copy_(full[key])
            rest = {n for n, p in self.gpt.named_parameters() if p.requires_grad and not lora.is_adapter(n)}
            # Beside adapters only some stages may train a tensor (a reward model's head lives on
            # the last pipeline stage), but the gather below is collective: every rank joins when
            # any rank has one, or the others wait in it until the collective timeout.
            if not self.adapter or all_max(float(bool(rest))):
                state = bridge.to_hf(self.gpt, self.hf_config, self.layout,
                                     keep=(lambda n: n in rest) if self.adapter else None)
                target = self.hf.state_dict()
                for k, v in state.items():
                    if k in target:
                        target[k].copy_(v)

    # -- step ----------------------------------------------------------------------------
    def forward_backward(self, batch: StepBatch, loss_fn) -> dict[str, float]:
        if self.mopt is not None:
            self.mopt.zero_grad()
        denom = reduce_scalar(batch.denom, group=self.dp_group)
        sums = self._schedule(list(batch.micro), loss_fn, 1.0 / max(denom, 1e-12), forward_only=False,
                              seeds=batch.micro_seeds)
        if self.mopt is not None:
            self.mopt.finalize()
        else:
            grads.reduce(self.gpt, self.tied, self.par.sequence_parallel)
        out = {k: reduce_scalar(v, group=self.dp_group) for k, v in sums.items()}
        # every stage has the names broadcast from the last one, but over a dry_run=trace's fake
        # group (which carries no data) a first stage has none
        loss = out.pop("loss_sum", 0.0) / max(denom, 1e-12)
        return {"loss": loss, **out}

    def forward_only(self, micro: dict, loss_fn) -> float:
        """A forward without gradient of one micro-batch (the checkpoint's replay probe), with the
        full vocabulary's logits also where the method reads vocabulary shards (distillation)."""
        head = self.module.head
        self.module.head = "gather" if head == "shard" else head
        try:
            if self.par.pp == 1:
                with cpu_device():  # the TP gather of the logits asks torch.cuda for a device
                    return forward_only(self.module, micro, loss_fn, self.pol, self.device)
            self.chunk.eval()
            try:
                with torch.no_grad():
                    return self._schedule([micro], loss_fn, 1.0, forward_only=True)["loss_sum"]
            finally:
                self.chunk.train()
        finally:
            self.module.head = head

    def _schedule(self, micro: list, loss_fn, scale: float, forward_only: bool, seeds=None) -> dict[str, float]:
        """Megatron-Core's schedule over `micro`; the method's summed metrics, summed over PP stages
        (only the last stage computes the loss: it names the sums, every stage joins, zeros elsewhere)."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func


        if not forward_only:
            self.chunk.train()
        length = max(m["input_ids"].shape[1] for m in micro)
        if self.par.ep > 1:
            # the MoE token dispatcher all-gathers tokens over the expert-parallel ranks, which hold
            # other examples: every rank's micro-batches get the longest length of all of them
            length = reduce_scalar(length, "max", dtype=torch.int64)
        if self.par.sequence_parallel:
            length = -(-length // self.par.tp) * self.par.tp
        if self.par.pp > 1 or self.par.sequence_parallel or self.par.ep > 1:
            micro = [pad_micro(m, length) for m in micro]
        sums: dict[str, float] = {}
        vocab, head = self.hf_config.vocab_size, self.module.head

        def loss_func(m, output):
            if self.par.pp == 1:
                loss_sum, metrics = output
            else:
                loss_sum, metrics = loss_fn(LogitsView(output, m, vocab, head), m)
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
                lora.set_enabled(model, True)
                out = stage_forward(model, m["input_ids"], m.get("attention_mask"), m.get("position_ids"))
            sent = self.gpt.config.pipeline_dtype
            if not ps.is_pipeline_last_stage() and out.dtype != sent:  # the next stage would misread it
                raise RuntimeError(f"megatron: stage output is {out.dtype} but stages exchange {sent}")
            return out, lambda o: loss_func(m, o)

        fb = get_forward_backward_func()
        with cpu_device():
            fb(forward_step_func=forward_step, data_iterator=iter(micro), model=[self.chunk],
               num_microbatches=len(micro), seq_length=length, micro_batch_size=micro[0]["input_ids"].shape[0],
               forward_only=forward_only)
        names = [sorted(sums)]
        pp_group = ps.get_pipeline_model_parallel_group()
        if self.par.pp > 1:
            dist.broadcast_object_list(names, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
        return {k: reduce_scalar(sums.get(k, 0.0), group=pp_group) for k in names[0]}

    def optimizer_step(self) -> dict[str, float]:
        if self.mopt is not None:
            o = self.ctx.cfg.optim
            lr = o.lr * lr_factor(self.steps, o, self.max_steps)
            gn = self.mopt.step(lr)
        else:
            gn = grads.norm(self.gpt, self.tied)
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
        # Methods that generate read unwrapped() every step, so they need the bridge back every step.
        if (self.steps >= t.train.max_steps or self.ctx.run.facts.generates
                or (t.eval.every_n_steps and self.steps % t.eval.every_n_steps == 0)):
            self._sync_hf()  # export and eval read the HF model; every rank joins the gather
        return {"grad_norm": float(gn), "lr": lr}

    def held(self) -> dict[str, list]:
        """The distributed optimizer's torch optimizers (over this rank's fp32 main shards) and
        Megatron-Core DDP's contiguous gradient buffers (the parameters' main_grad), or the plain optimizer."""
        if self.mopt is None:
            return {"optimizers": [self.optimizer], "grads": []}
        ddp = self.mopt.ddp
        return {"optimizers": [part.optimizer for part in self.mopt.parts],
                "grads": [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers if b.grad_data is not None]}

    def local_bytes(self) -> dict[str, int]:
        """Bytes of the GPTModel's parameters and of the optimizer state this rank holds."""
        params = sum(p.numel() * p.element_size() for p in self.gpt.parameters())
        if self.mopt is not None:
            return {"params": params, "optimizer": self.mopt.local_bytes()}
        optim = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "optimizer": optim}

    # -- state (workbench/backends/megatron_state.py) ---------------------------------------------
    def canonical_state(self) -> dict:
        return state.canonical_state(self)

    def load_canonical(self, read) -> None:
        state.load_canonical(self, read)

    def load_legacy(self, path, rank: int) -> None:
        state.load_legacy(self, path, rank)

    def schedule_state(self) -> dict:
        sched = canonical.schedule_state(self.scheduler) if self.scheduler is not None else {}
        return {**sched, "steps": self.steps}  # the distributed optimizer's lr follows self.steps

    def load_schedule(self, state: dict) -> None:
        if self.scheduler is not None:
            canonical.apply_schedule(self.scheduler, self.optimizer, {k: v for k, v in state.items() if k != "steps"})
        self.steps = int(state.get("steps", state.get("last_epoch", 0)))


def _release_base(model: nn.Module) -> None:
    """Replace the HF model's frozen parameters (the LoRA base the GPTModel now holds) by meta
    tensors of their shapes: no memory, and any use fails loudly; shared (tied) ones stay shared."""
    meta: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and not p.requires_grad:
                if id(p) not in meta:
                    meta[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                mod._parameters[name] = meta[id(p)]


def build(cfg, ctx) -> MegatronBackend:
    require_megatron()
    return MegatronBackend(cfg, ctx)


def _unmapped_targets(c) -> list[str]:
    """peft.target_modules that name no Megatron linear (workbench/megatron/lora.py TARGETS)."""
    wanted = c.peft.target_modules
    if wanted in ("all-linear", None):
        return []
    wanted = [wanted] if isinstance(wanted, str) else list(wanted)
    return [t for t in wanted if t not in TARGETS]


def _distopt(c) -> bool:
    return bool(pick(c, "backend.distributed_optimizer", False))


RULES = (
    Rule("qlora-megatron", {"peft": "qlora", "backend": "megatron"},
         lambda c, e: rule.peft(c) == "qlora",
         "peft=qlora is not supported on backend=megatron (no 4-bit Megatron layers); use peft=lora there, "
         "or peft=qlora with backend=fsdp2"),
    Rule("dora-megatron", {"peft": "dora", "backend": "megatron"},
         lambda c, e: rule.peft(c) == "dora",
         "peft=dora is not built for backend=megatron (a row-parallel layer's weight norms would need a TP "
         "all-reduce per step); use peft=lora there, or peft=dora with backend=fsdp2"),
    Rule("megatron-needs-package", {"backend": "megatron"},
         lambda c, e: not e.has("megatron"),
         "backend=megatron needs megatron-core: pip install -e '.[megatron]' (or use backend=fsdp2)", machine=True),
    # the parallel sizes first: when several rules apply, the sizes are what to fix first
    Rule("tp-divides-heads", {"backend": "megatron (tp)"},
         lambda c, e: rule.par(c, "tp") > 1 and (c.model.arch.heads % rule.par(c, "tp")
                                                 or c.model.arch.kv_heads % rule.par(c, "tp")),
         lambda c, e: f"backend.tp={rule.par(c, 'tp')} must divide the attention heads ({c.model.arch.heads}) and KV "
                      f"heads ({c.model.arch.kv_heads}) of model={c.model.name}; choose a divisor of "
                      f"{c.model.arch.kv_heads}"),
    Rule("pp-divides-layers", {"backend": "megatron (pp)"},
         lambda c, e: rule.par(c, "pp") > 1 and c.model.arch.layers % rule.par(c, "pp"),
         lambda c, e: f"backend.pp={rule.par(c, 'pp')} must divide the {c.model.arch.layers} layers of "
                      f"model={c.model.name}; choose a divisor of {c.model.arch.layers}"),
    Rule("parallel-divides-world", {"backend": "megatron (tp x pp x cp)", "hardware": "devices"},
         lambda c, e: layout(c).world % (rule.par(c, "tp") * rule.par(c, "pp") * rule.par(c, "cp")) != 0,
         lambda c, e: f"backend.tp x pp x cp = {rule.par(c, 'tp') * rule.par(c, 'pp') * rule.par(c, 'cp')} must "
                      f"divide the {layout(c).world} devices (hardware.procs x hardware.nodes); change the parallel "
                      "sizes or the devices"),
    Rule("ep-needs-experts", {"backend": "megatron (ep)", "model": "dense or experts not divisible"},
         lambda c, e: rule.par(c, "ep") > 1 and (not c.model.arch.experts or c.model.arch.experts % rule.par(c, "ep")),
         lambda c, e: f"backend.ep={rule.par(c, 'ep')} needs a MoE model whose experts ({c.model.arch.experts}) it "
                      f"divides; use backend.ep=1 for model={c.model.name}"),
    Rule("cp-divides-seq", {"backend": "megatron (cp)", "data": "seq_len"},
         lambda c, e: rule.par(c, "cp") > 1 and c.data.seq_len % (2 * rule.par(c, "cp")),
         lambda c, e: f"backend.cp={rule.par(c, 'cp')} splits each sequence in 2 x cp chunks: make data.seq_len a "
                      f"multiple of {2 * rule.par(c, 'cp')}"),
    Rule("megatron-fp8", {"backend": "megatron", "precision": "backend.fp8"},
         lambda c, e: pick(c, "backend.fp8", None) is not None,
         "backend.fp8 needs Transformer Engine layer specs, which backend=megatron does not build yet: set backend.fp8=null"),
    Rule("megatron-distopt-fp16", {"backend": "megatron (distributed optimizer)", "precision": "fp16"},
         lambda c, e: _distopt(c) and rule.precision(c) == "fp16",
         "backend.distributed_optimizer=true keeps fp16 weights only with Megatron's loss scaler, which the "
         "backend's schedule does not apply: use precision=bf16-mixed (or fp32)"),
    Rule("megatron-distopt-adam", {"backend": "megatron (distributed optimizer)", "other": "optim.name=sgd"},
         lambda c, e: _distopt(c) and c.optim.name != "adamw",
         lambda c, e: f"backend.distributed_optimizer=true shards Adam's state; Megatron-Core 0.16's distributed "
                      f"optimizer steps Adam only (distrib_optimizer.py:516): use optim.name=adamw, or "
                      f"backend.distributed_optimizer=false for optim.name={c.optim.name}"),
    Rule("megatron-moe-tp-needs-sp", {"backend": "megatron (tp > 1)", "model": "mixture of experts"},
         lambda c, e: bool(c.model.arch.experts) and rule.par(c, "tp") > 1
         and not bool(pick(c, "backend.sequence_parallel", False)),
         lambda c, e: f"model={c.model.name} has experts: Megatron-Core's MoE layer refuses to train with "
                      f"backend.tp={rule.par(c, 'tp')} and no sequence parallelism (without it every TP rank routes "
                      "the same tokens and expert gradients come out tp times too large): set backend.tp=1 "
                      "with backend.ep for the experts (sequence parallelism needs Transformer Engine layer "
                      "specs, which backend=megatron does not build yet)"),
    # Megatron-Core's local layer spec takes torch's norm (WrappedTorchNorm asserts on
    # sequence_parallel) or Apex's FusedLayerNorm (LayerNorm only, never RMSNorm): no machine
    # builds these models with it, so the run would stop at the model build after its load
    Rule("megatron-sequence-parallel", {"backend": "megatron (sp)"},
         lambda c, e: bool(pick(c, "backend.sequence_parallel", False)),
         "backend.sequence_parallel=true needs Transformer Engine layer specs (an RMSNorm that splits the "
         "tokens), which backend=megatron does not build yet: torch's norm in Megatron-Core's local spec "
         "refuses it and Apex's is LayerNorm only; set backend.sequence_parallel=false"),
    Rule("megatron-cp-needs-gpu", {"backend": "megatron (cp)", "hardware": "cpu"},
         lambda c, e: rule.par(c, "cp") > 1 and rule.device(c) != "cuda",
         "backend.cp > 1 needs Transformer Engine's attention on a GPU", machine=True),
    Rule("megatron-recompute-choice", {"backend": "megatron"},
         lambda c, e: pick(c, "backend.recompute", "none") not in ("none", "selective", "full"),
         lambda c, e: f"backend.recompute={pick(c, 'backend.recompute', 'none')!r} is not one of none, selective, full"),
    # after the parallel sizes, which report first when several apply
    Rule("lora-megatron-dropout", {"peft": "lora (dropout > 0)", "backend": "megatron"},
         lambda c, e: rule.peft(c) == "lora" and float(c.peft.dropout) > 0,
         lambda c, e: f"peft.dropout={c.peft.dropout}: LoRA on Megatron layers draws no dropout mask (the "
                      "column adapters' input is replicated over TP, so masks would have to agree across ranks); "
                      "set peft.dropout=0"),
    Rule("lora-megatron-targets", {"peft": "lora (target_modules)", "backend": "megatron"},
         lambda c, e: rule.peft(c) == "lora" and bool(_unmapped_targets(c)),
         lambda c, e: f"peft.target_modules: {_unmapped_targets(c)} have no Megatron linear to adapt; backend=megatron "
                      f"maps {sorted(TARGETS)} (or all-linear)"),
    Rule("megatron-family", {"backend": "megatron", "model": "a family without an HF<->Megatron mapping"},
         lambda c, e: c.model.arch.family not in families.megatron_model_types(),
         lambda c, e: f"backend=megatron has no HF<->Megatron mapping for model family {c.model.arch.family!r} "
                      f"(model={c.model.name}); use backend=fsdp2 for it"),
)

def terms(node) -> BackendTerms:
    """The planner's terms: expert parallelism, recompute (none | selective | full), the
    distributed optimizer and sequence parallelism. tp, pp and cp reach the planner through the run's layout
    (workbench/train/layout.py)."""
    return BackendTerms(ep=int(getattr(node, "ep", 1)), checkpointing=checkpointing(getattr(node, "recompute", None)),
                        distributed_optimizer=on(getattr(node, "distributed_optimizer", False)),
                        tp_splits_tokens=on(getattr(node, "sequence_parallel", False)))


SPEC = BackendSpec(name="megatron", config=Config, build=build, rules=RULES, terms=terms,
                   facts=BackendFacts(model_parallel=True, half_compute=True, checkpointing_field="recompute",
                                      head_every_position=True, gathers_logits=True, bridges_hf_model=True,
                                      fixed_positions=True,
                                      untraced_with_experts="Megatron-Core's token dispatcher sizes each "
                                                            "expert's batch from the router's choices "
                                                            "(masked_select), values fake tensors do not "
                                                            "carry",
                                      untraced_generating="the step bridges its adapters back into the HF "
                                                          "model that generates, gathering every rank's "
                                                          "shards as objects, which a fake group cannot "
                                                          "answer"))
