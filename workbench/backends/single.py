"""backend=single: one device, or DistributedDataParallel when the world size is > 1.

This is the reference backend: CPU tests, golden loss curves and the other backends'
equivalence tests are all measured against it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.backends.base import Backend
from workbench.backends.spec import BackendFacts, BackendSpec
from workbench.backends.step import accumulate, clip_and_step, forward_only
from workbench.checkpoints import canonical
from workbench.compute.optim import build_optimizer, build_scheduler
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch


@dataclass
class Config:
    name: str = "single"  # the backend; backend=single sets it
    # DDP (more than one process): allow trainable parameters that get no gradient in a step, at the
    # cost of a graph walk per step (DistributedDataParallel's flag of this name)
    find_unused_parameters: bool = False
    sp: int = 1  # sequence parallelism: ranks sharing every row's tokens (workbench/train/sequence_parallel.py)


class SingleBackend(Backend):
    name = "single"
    skips_steps = True

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.model: torch.nn.Module | None = None
        self.ddp: torch.nn.Module | None = None

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, ctx) -> None:
        self.model = model
        self.pol = ctx.run.precision
        self.device = ctx.device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        sequence_parallel.start(self.cfg.sp, model)
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(model, find_unused_parameters=self.cfg.find_unused_parameters)
        self.optimizer = build_optimizer(model.parameters(), ctx.cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, ctx.cfg.optim, ctx.cfg.train.max_steps)
        self.scaler = torch.amp.GradScaler(self.device) if self.pol.loss_scaling else None
        self.max_grad_norm = ctx.cfg.optim.max_grad_norm
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    def unwrapped(self) -> torch.nn.Module:
        return self.model

    def generation(self):
        return contextlib.nullcontext((self.model.inner, False))  # full weights on every rank

    # -- step ----------------------------------------------------------------------------
    def forward_backward(self, batch: StepBatch, loss_fn) -> dict[str, float]:
        net = self.ddp or self.model
        net.train()

        def sync(last: bool):  # DDP all-reduces gradients on the last micro-batch only
            return contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()

        return accumulate(net, batch, loss_fn, self.pol, self.device, self.world, self.scaler, sync)

    def optimizer_step(self) -> dict[str, float]:
        return clip_and_step(self.model.parameters(), self.optimizer, self.scheduler, self.scaler,
                             self.max_grad_norm)

    def forward_only(self, micro: dict, loss_fn) -> float:
        return forward_only(self.model, micro, loss_fn, self.pol, self.device)

    # -- state (workbench/checkpoints/canonical.py; DDP replicas write each key once) ---------------
    def canonical_state(self) -> dict:
        return canonical.torch_state(self.model, self.optimizer, self.trainable)

    def load_canonical(self, read) -> None:
        canonical.torch_load(self.model, self.optimizer, self.trainable, read)

    def schedule_state(self) -> dict:
        return canonical.schedule_state(self.scheduler, self.scaler)

    def load_schedule(self, state: dict) -> None:
        canonical.apply_schedule(self.scheduler, self.optimizer, state, self.scaler)

    def load_legacy(self, path, rank: int) -> None:
        """model.safetensors + optim.pt (position-indexed optimizer state), written by rank 0."""
        from safetensors.torch import load_file

        weights = load_file(path / "model.safetensors")
        rest = torch.load(path / "optim.pt", weights_only=True)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in weights.items():
                params[n].copy_(t)
        self.optimizer.load_state_dict(rest["optimizer"])
        self.scheduler.load_state_dict(rest["scheduler"])
        if self.scaler and rest.get("scaler"):
            self.scaler.load_state_dict(rest["scaler"])


def build(cfg, ctx) -> SingleBackend:
    return SingleBackend(cfg, ctx)


SPEC = BackendSpec(name="single", config=Config, build=build,
                   facts=BackendFacts(loads_unsloth=True, loads_4bit=True,
                                      untraced_over_processes="over several processes it is "
                                      "DistributedDataParallel, whose C++ reducer reads the parameters' data to "
                                      "build its buckets (fake tensors have none); backend=fsdp2 is traced"))
