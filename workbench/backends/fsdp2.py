"""backend=fsdp2: PyTorch FSDP2 (`fully_shard`) with DCP checkpoints.

    python -m workbench backend=fsdp2 hardware.procs=2            # starts torchrun itself
    torchrun --nproc_per_node=2 -m workbench backend=fsdp2        # or under your own launcher

Every decoder block is its own `fully_shard` group, then the root (SelectiveLM around the
possibly-PEFT model) takes what is left (embeddings, final norm, lm_head). Parameters become
DTensors sharded on dim 0 over all ranks; `wrap` checks that they really are and stops
otherwise. Gradients are reduce-scattered and averaged over ranks, like DDP, so the loss
scaling below matches backend=single exactly at equal global batch.

Checkpoints are the canonical format (workbench/checkpoints/canonical.py): each rank writes its own
DTensor shards, and any layout reads them. With peft, only the trainable (adapter) tensors are
saved; the frozen base is reloaded from its source.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.backends.base import Backend
from workbench.backends.spec import BackendFacts, BackendSpec, BackendTerms, checkpointing, on, syncs_each_micro_batch
from workbench.backends.step import accumulate, clip_and_step, forward_only
from workbench.checkpoints import canonical
from workbench.compute.optim import build_optimizer, build_scheduler
from workbench.config import rule
from workbench.config.rule import Rule
from workbench.config.schema import pick
from workbench.models.build import rebuild_plain
from workbench.peft.lora import base_model
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch
from workbench.train.distributed import ensure_process_group


@dataclass
class Config:
    name: str = "fsdp2"  # the backend; backend=fsdp2 sets it
    reshard_after_forward: bool = True  # free gathered weights after forward (ZeRO-3-like); False ~ ZeRO-2
    cpu_offload: bool = False  # keep sharded params, grads and optimizer state in host memory
    activation_checkpointing: str = "none"  # none | full (every block) | selective (every Nth block)
    selective_every: int = 2  # activation_checkpointing=selective: blocks 0, N, 2N, ... recompute
    reduce_dtype: str = "float32"  # gradient reduce-scatter dtype under mixed precision
    async_checkpoint: bool = False  # DCP async_save: training continues while shards are written
    sp: int = 1  # sequence parallelism: ranks sharing every row's tokens (workbench/train/sequence_parallel.py)
    # train.grad_accum > 1: reduce-scatter gradients after every micro-batch (true), only after the
    # last (false: each rank holds its unsharded gradients until then), or auto: every micro-batch
    # unless only adapters train (workbench/backends/spec.py syncs_each_micro_batch)
    sync_each_micro_batch: str = "auto"


def decoder_blocks(module: torch.nn.Module) -> torch.nn.ModuleList:
    lm = base_model(module.inner)
    blocks = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise RuntimeError(f"fsdp2: cannot find the decoder blocks (model.layers) of {type(lm).__name__}")
    return blocks


def keep_quant_state(model: torch.nn.Module) -> None:
    """QLoRA: sharding turns Params4bit into DTensors and drops their quantisation constants;
    bitsandbytes recovers them from the owning module, so put them there before sharding."""
    for mod in model.modules():
        qs = getattr(getattr(mod, "weight", None), "quant_state", None)
        if qs is not None and getattr(mod, "quant_state", None) is None:
            mod.quant_state = qs


class FSDP2Backend(Backend):
    name = "fsdp2"
    skips_steps = True

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self._ckpt_group = None  # async checkpoints: a process group of their own
        self._forwarded = False  # has a forward gone through the root yet (FSDP picks its root then)

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, ctx) -> None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        ensure_process_group(ctx.device)
        self.model, self.pol, self.device = model, ctx.run.precision, ctx.device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        sequence_parallel.start(self.cfg.sp, model)
        self._activation_checkpointing(model)
        # The compute dtype: params are all-gathered in it, so no autocast is needed for matmuls.
        # Pure bf16 still sets it, because fp32 adapters and bf16 base weights share a group.
        param_dtype = self.pol.autocast_dtype or (self.pol.trainable_dtype
                                                 if self.pol.trainable_dtype != torch.float32 else None)
        mp = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=getattr(torch, self.cfg.reduce_dtype) if param_dtype else None)
        keep_quant_state(model)
        # The mesh holds real rank numbers even where a dry run traces this wrap on fake tensors
        # (workbench/plan/trace.py): made under fake tensors, it could not say which rank holds what.
        with unset_fake_temporarily():
            mesh = init_device_mesh(self.device, (self.world,))
        kw = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=self.cfg.reshard_after_forward)
        if self.cfg.cpu_offload:
            kw["offload_policy"] = CPUOffloadPolicy()
        for block in decoder_blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        # FSDP fixes each group's gradient dtypes from the parameters that require grad at its
        # lazy init, which a first forward runs. PEFT's disable_adapter() turns the adapters'
        # requires_grad off, so a first forward through the adapter-free reference (DPO, KTO,
        # GRPO's KL) would leave no trainable parameter in any group: under mixed precision the
        # bf16 gradients then never become fp32 ("grad_dtype 'Float'"). Initialise now, while the
        # adapters train; the root is this module.
        model._get_fsdp_state()._lazy_init()
        self._forwarded = True
        self.verify_sharded()
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        # DTensor.numel() is the whole parameter's, so every rank decides alike
        self.sync_each = syncs_each_micro_batch(
            self.cfg.sync_each_micro_batch, sum(p.numel() for p in model.parameters() if p.requires_grad),
            sum(p.numel() for p in model.parameters()))
        self.optimizer = build_optimizer(model.parameters(), ctx.cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, ctx.cfg.optim, ctx.cfg.train.max_steps)
        self.scaler = torch.amp.GradScaler(self.device) if self.pol.loss_scaling else None
        self.max_grad_norm = ctx.cfg.optim.max_grad_norm

    def _activation_checkpointing(self, model) -> None:
        mode = self.cfg.activation_checkpointing
        if mode == "none":
            return
        lm = base_model(model.inner)
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.ctx.run.peft.adapter:
            lm.enable_input_require_grads()
        if mode == "selective":  # recompute every Nth block only: trades less memory for less recompute
            for i, block in enumerate(decoder_blocks(model)):
                block.gradient_checkpointing = i % self.cfg.selective_every == 0

    def verify_sharded(self) -> None:
        """The user asked for FSDP: every parameter must be a DTensor sharded over all ranks."""
        from torch.distributed.tensor import DTensor, Shard

        for n, p in self.model.named_parameters():
            if not isinstance(p, DTensor) or not any(isinstance(pl, Shard) for pl in p.placements):
                raise RuntimeError(f"fsdp2: parameter {n} is not sharded (type {type(p).__name__}); "
                                   "refusing to continue as if it were")
            if p.device_mesh.size() != self.world:
                raise RuntimeError(f"fsdp2: parameter {n} is sharded over {p.device_mesh.size()} ranks, "
                                   f"not the world of {self.world}")

    def unwrapped(self) -> torch.nn.Module:
        return self.model

    @contextlib.contextmanager
    def generation(self):
        """(module, synced) for HF generate on the sharded model (GRPO rollouts).

        generate calls the inner model, not the root's forward, so the root unit (embeddings,
        final norm, head) is gathered here for the whole call; each block gathers in its own
        forward hook. A first forward through the root settles which FSDP state is the root.
        Ranks stop at different lengths, so generate keeps stepping until all are done
        (synced); otherwise one rank would wait in an all-gather the others never join.
        """
        if not self._forwarded:
            with torch.no_grad():
                self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
            self._forwarded = True
        self.model.unshard()
        try:
            yield self.model.inner, self.world > 1
        finally:
            self.model.reshard()

    def local_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state held by this rank (its shards)."""
        params = sum(p.to_local().numel() * p.element_size() for p in self.model.parameters())
        optim = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                    for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        return {"params": params, "optimizer": optim}

    # -- step ----------------------------------------------------------------------------
    def forward_backward(self, batch: StepBatch, loss_fn) -> dict[str, float]:
        self.model.train()
        self._forwarded = True

        def sync(last: bool):  # every micro-batch, or only the last (Config.sync_each_micro_batch)
            self.model.set_requires_gradient_sync(last or self.sync_each)
            return contextlib.nullcontext()

        return accumulate(self.model, batch, loss_fn, self.pol, self.device, self.world, self.scaler, sync)

    def optimizer_step(self) -> dict[str, float]:
        return clip_and_step(self.model.parameters(), self.optimizer, self.scheduler, self.scaler,
                             self.max_grad_norm)

    def forward_only(self, micro: dict, loss_fn) -> float:
        self._forwarded = True
        return forward_only(self.model, micro, loss_fn, self.pol, self.device)

    # -- state (workbench/checkpoints/canonical.py: each rank writes its DTensor shards) -------------
    def canonical_state(self) -> dict:
        return canonical.torch_state(self.model, self.optimizer, self.trainable)

    def save_canonical(self, path: Path):
        if not self.cfg.async_checkpoint:
            return canonical.write(path, self.canonical_state())
        # Shards are staged to host memory now and written in a background thread; the
        # checkpoint only becomes `latest` once the returned future has completed. The
        # thread's collectives get their own process group, so they never interleave with
        # the training step's.
        if self._ckpt_group is None:
            self._ckpt_group = dist.new_group(backend="gloo")
        return canonical.write(path, self.canonical_state(), process_group=self._ckpt_group, async_save=True)

    def load_canonical(self, read) -> None:
        canonical.torch_load(self.model, self.optimizer, self.trainable, read)

    def schedule_state(self) -> dict:
        return canonical.schedule_state(self.scheduler, self.scaler)

    def load_schedule(self, state: dict) -> None:
        canonical.apply_schedule(self.scheduler, self.optimizer, state, self.scaler)

    def load_legacy(self, path: Path, rank: int) -> None:
        """dcp/ (DCP's own format, its metadata pickled) + schedule.pt."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

        msd, osd = get_state_dict(self.model, self.optimizer)
        state = {"model": {k: v for k, v in msd.items() if k in set(self.trainable)}, "optim": osd}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        rest = torch.load(Path(path) / "schedule.pt", weights_only=True)
        self.scheduler.load_state_dict(rest["scheduler"])
        if self.scaler and rest.get("scaler"):
            self.scaler.load_state_dict(rest["scaler"])

    def gathered_model(self):
        """Collective: a plain copy of the trained model with full weights on rank 0, None elsewhere."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None

        return rebuild_plain(self.ctx.run, full, only=set(self.trainable))


def build(cfg, ctx) -> FSDP2Backend:
    return FSDP2Backend(cfg, ctx)


RULES = (
    Rule("fsdp2-model-checkpointing", {"backend": "fsdp2", "other": "model.gradient_checkpointing"},
         lambda c, e: c.model.gradient_checkpointing,
         "under backend=fsdp2 use backend.activation_checkpointing=full instead of model.gradient_checkpointing=true"),
    Rule("fsdp2-checkpointing-choice", {"backend": "fsdp2", "other": "activation checkpointing"},
         lambda c, e: pick(c, "backend.activation_checkpointing", "none") not in ("none", "full", "selective")
         or int(pick(c, "backend.selective_every", 2)) < 1,
         lambda c, e: "config field 'backend.activation_checkpointing' must be none, full or selective, and "
                      f"'backend.selective_every' >= 1 (got {pick(c, 'backend.activation_checkpointing', 'none')!r}, "
                      f"{pick(c, 'backend.selective_every', 2)})"),
    Rule("fsdp2-reduce-dtype", {"backend": "fsdp2", "precision": "reduce dtype"},
         lambda c, e: pick(c, "backend.reduce_dtype", "float32") not in ("float32", "bfloat16", "float16"),
         lambda c, e: f"config field 'backend.reduce_dtype' must be float32, bfloat16 or float16 "
                      f"(got {pick(c, 'backend.reduce_dtype', 'float32')!r})"),
    Rule("fsdp2-sync-choice", {"backend": "fsdp2", "other": "gradient accumulation"},
         lambda c, e: str(pick(c, "backend.sync_each_micro_batch", "auto")).lower() not in ("auto", "true", "false"),
         lambda c, e: "config field 'backend.sync_each_micro_batch' must be auto, true or false "
                      f"(got {pick(c, 'backend.sync_each_micro_batch', 'auto')!r})"),
    Rule("fsdp2-offload-on-cpu", {"backend": "fsdp2", "offload": "cpu_offload", "hardware": "cpu"},
         lambda c, e: bool(pick(c, "backend.cpu_offload", False)) and rule.device(c) == "cpu",
         "backend.cpu_offload moves GPU memory to the host; on hardware=cpu set backend.cpu_offload=false"),
)

def terms(node) -> BackendTerms:
    """The planner's terms: cpu_offload keeps shards, gradients and optimizer state on the host;
    activation_checkpointing and selective_every; sync_each_micro_batch. FSDP2 has no stage
    option (its facts' default stage, 3)."""
    host = on(getattr(node, "cpu_offload", False))
    return BackendTerms(offload_optimizer=host, offload_params=host,
                        checkpointing=checkpointing(getattr(node, "activation_checkpointing", None)),
                        checkpoint_every=int(getattr(node, "selective_every", 2)),
                        accum_sync=str(getattr(node, "sync_each_micro_batch", "auto")))


SPEC = BackendSpec(name="fsdp2", config=Config, build=build, rules=RULES, terms=terms,
                   facts=BackendFacts(default_stage=3, shards_from_stage=3, half_compute=True, regathers_root=True,
                                      checkpointing_field="activation_checkpointing", loads_4bit=True,
                                      accumulation_sync_field="sync_each_micro_batch"))
