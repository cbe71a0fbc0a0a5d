"""backend=deepspeed: DeepSpeed ZeRO stage 1, 2 or 3, optional CPU/NVMe offload, its own checkpoints.

    python -m workbench backend=deepspeed backend.stage=3 hardware.procs=2
    python -m workbench backend=deepspeed backend.stage=2 backend.offload_optimizer=cpu hardware.procs=8

The optimizer and learning-rate schedule are the workbench's own (optim=), handed to
DeepSpeed, so a ZeRO run and a backend=single run take identical optimizer steps; DeepSpeed
adds the partitioning, clipping (optim.max_grad_norm) and, for bf16/fp16, its master weights.
The ZeRO-3 knobs have the names of DeepSpeed's own JSON fields. On CPU, DeepSpeed needs
DS_ACCELERATOR=cpu, which this module sets before importing it.

Checkpoints are DeepSpeed's (`engine.save_checkpoint`) inside the workbench step directory;
with peft only the trainable tensors are written. They are DeepSpeed's pickled format, read
back only from this run's own output_dir.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.backends.base import Backend
from workbench.backends.step import all_sum
from workbench.core.errors import missing_package
from workbench.train.batch import StepBatch
from workbench.train.optim import build_optimizer, build_scheduler

TAG = "zero"  # DeepSpeed's checkpoint tag inside each workbench step directory


@dataclass
class Config:
    name: str = "deepspeed"
    stage: int = 3
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)
    nvme_path: str = ""
    pin_memory: bool = True
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000


def available() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ValueError, ImportError):  # a blocked or broken import
        return False


def _import():
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    try:
        import deepspeed
    except ImportError:
        raise missing_package("deepspeed", "deepspeed") from None
    if os.environ["DS_ACCELERATOR"] == "cpu":
        # DeepSpeed's CPU communicator JIT-compiles its shared-memory all-reduce op (C++, about
        # 60 s on a 2-core machine) when the process group starts; only inference_all_reduce
        # (inference tensor parallelism) uses it, and training all-reduces through the gloo
        # group either way. deepspeed.ops.__compatible_ops__ is the documented, editable list
        # of the ops this launch may build; marking the op unavailable skips the build.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def ds_config(cfg, tcfg, pol, max_grad_norm: float, n_params: int = 1 << 62) -> dict:
    """The DeepSpeed JSON config from the workbench's config.

    Buckets are buffers of that many elements; one larger than the model only wastes memory
    (DeepSpeed allocates them whole), so they are capped at the number of parameters.
    """
    cap = max(int(n_params), 1)
    zero: dict = {
        "stage": cfg.stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": cfg.contiguous_gradients,
        "reduce_bucket_size": min(cfg.reduce_bucket_size, cap),
        "allgather_bucket_size": min(cfg.allgather_bucket_size, cap),
    }
    if cfg.stage == 3:
        zero.update(stage3_prefetch_bucket_size=min(cfg.stage3_prefetch_bucket_size, cap),
                    stage3_param_persistence_threshold=cfg.stage3_param_persistence_threshold,
                    stage3_max_live_parameters=cfg.stage3_max_live_parameters,
                    stage3_max_reuse_distance=cfg.stage3_max_reuse_distance)
    for what in ("optimizer", "param"):
        kind = cfg[f"offload_{what}"]
        if kind != "none":
            zero[f"offload_{what}"] = {"device": kind, "pin_memory": cfg.pin_memory,
                                       **({"nvme_path": cfg.nvme_path} if kind == "nvme" else {})}
    out = {
        "train_micro_batch_size_per_gpu": tcfg.micro_batch_size,
        "gradient_accumulation_steps": tcfg.grad_accum,
        "gradient_clipping": max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the workbench's torch AdamW, for identical steps
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if pol.name in ("bf16", "bf16-mixed"):
        out["bf16"] = {"enabled": True}
    elif pol.name == "fp16":
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return out


class DeepSpeedBackend(Backend):
    name = "deepspeed"
    sharded = True
    external_checkpoint = True  # DeepSpeed writes and reads its own checkpoint files

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, ctx) -> None:
        deepspeed = _import()
        from workbench.train.distributed import ensure_process_group

        ensure_process_group(ctx.device)
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device == "cuda" else "gloo")
        self.model, self.pol = model, ctx.run.precision
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        optim_cfg, max_steps = ctx.cfg.optim, ctx.cfg.train.max_steps
        config = ds_config(self.cfg, ctx.cfg.train, self.pol, optim_cfg.max_grad_norm,
                           n_params=sum(p.numel() for p in model.parameters()))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=lambda params: build_optimizer(params, optim_cfg),
            lr_scheduler=lambda opt: build_scheduler(opt, optim_cfg, max_steps), config=config)
        self.verify_sharded()

    def verify_sharded(self) -> None:
        """The user asked for ZeRO-N: check DeepSpeed really partitioned what that stage partitions."""
        eng = self.engine
        if eng.zero_optimization_stage() != self.cfg.stage:
            raise RuntimeError(f"deepspeed: asked for ZeRO stage {self.cfg.stage}, engine runs stage "
                               f"{eng.zero_optimization_stage()}")
        if self.cfg.stage == 3:
            for n, p in self.model.named_parameters():
                if not hasattr(p, "ds_tensor"):
                    raise RuntimeError(f"deepspeed: parameter {n} is not ZeRO-3 partitioned")
                if p.ds_tensor.numel() > -(-p.ds_numel // self.world):
                    raise RuntimeError(f"deepspeed: parameter {n} holds {p.ds_tensor.numel()} of {p.ds_numel} "
                                       f"elements on one of {self.world} ranks")
        else:
            kind = type(eng.optimizer).__name__
            if kind != "DeepSpeedZeroOptimizer":
                raise RuntimeError(f"deepspeed: ZeRO stage {self.cfg.stage} expected, optimizer is {kind}")

    def unwrapped(self) -> torch.nn.Module:
        return self.model

    @contextlib.contextmanager
    def generation(self):
        """(module, synced) for HF generate (GRPO rollouts). Under ZeRO-3 every submodule fetches
        its partitions in its own forward hook, so the inner model generates as it is; ranks
        stop at different lengths, so generate keeps stepping until all are done (synced)."""
        yield self.model.inner, self.cfg.stage == 3 and self.world > 1

    def local_bytes(self) -> dict[str, int]:
        """Bytes of parameters and optimizer state held by this rank (its partitions)."""
        if self.cfg.stage == 3:
            params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.model.parameters())
        else:
            params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        optim = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "optimizer": optim}

    # -- step ----------------------------------------------------------------------------
    def forward_backward(self, batch: StepBatch, loss_fn) -> dict[str, float]:
        self.engine.train()
        denom = all_sum(batch.denom)
        # ZeRO averages gradients over ranks (like DDP); the workbench normalises by the
        # global denominator itself, so DeepSpeed's own 1/grad_accum scaling is turned off.
        scale = self.world / max(denom, 1e-12)
        total, sums = 0.0, {}
        for i, micro in enumerate(batch.micro):
            loss_sum, metrics = loss_fn(self.engine, micro)
            self.engine.backward(loss_sum.float() * scale, scale_wrt_gas=False)
            if i < len(batch.micro) - 1:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
            total += float(loss_sum.detach())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return {"loss": all_sum(total) / max(denom, 1e-12), **sums}

    def optimizer_step(self) -> dict[str, float]:
        lr = self.scheduler.get_last_lr()[0]
        self.engine.step()  # the accumulation boundary: clip, step, schedule, zero grads
        gn = self.engine.get_global_grad_norm()
        return {"grad_norm": float(gn) if gn is not None else float("nan"), "lr": lr}

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"writer": self.save_to}

    def save_to(self, path: Path):
        self.engine.save_checkpoint(str(path), tag=TAG, save_latest=False,
                                    exclude_frozen_parameters=self.ctx.run.peft.adapter)
        return None

    def load_from(self, path: Path) -> None:
        load_path, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_module_strict=False,
                                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"deepspeed: no checkpoint under {path}/{TAG}")

    def load_state_dict(self, state: dict) -> None:
        self.load_from(state["path"])

    def gathered_model(self):
        """Collective: a plain copy of the trained model with full weights on rank 0, None elsewhere."""
        import deepspeed

        from workbench.models.build import rebuild_plain

        names = set(self.trainable) if self.ctx.run.peft.adapter else None
        params = [p for n, p in self.model.named_parameters() if names is None or n in names]
        full = {}
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=self.cfg.stage == 3):
            if self.rank == 0:
                full = {n: p.detach().float().cpu().clone() for n, p in self.model.named_parameters()
                        if names is None or n in names}
        if self.rank != 0:
            return None
        return rebuild_plain(self.ctx.run, full, only=names)


def build(cfg, ctx) -> DeepSpeedBackend:
    return DeepSpeedBackend(cfg, ctx)
