"""backend=deepspeed: DeepSpeed ZeRO stage 1, 2 or 3, optional CPU/NVMe offload, its own checkpoints.

    python -m workbench backend=deepspeed backend.stage=3 hardware.procs=2
    python -m workbench backend=deepspeed backend.stage=2 backend.offload_optimizer=cpu hardware.procs=8

The optimizer and learning-rate schedule are the workbench's own (optim=), handed to
DeepSpeed, so a ZeRO run and a backend=single run take identical optimizer steps; DeepSpeed
adds the partitioning, clipping (optim.max_grad_norm) and, for bf16/fp16, its master weights.
The ZeRO-3 knobs have the names of DeepSpeed's own JSON fields. On CPU, DeepSpeed needs
DS_ACCELERATOR=cpu, which this module sets before importing it.

Checkpoints are the canonical format (workbench/checkpoints/canonical.py), through DeepSpeed's
per-parameter accessors (deepspeed.utils.safe_get/set_full_fp32_param and _optimizer_state):
writing, every rank joins each parameter's gather and the parameter's owner (index % world)
keeps the full fp32 master and Adam moments; reading, every rank reads the full tensors in
chunks and keeps its fragment. So any ZeRO stage at any world size, FSDP2, single and Megatron
read what ZeRO wrote and the other way round; with peft only the trainable tensors are written.
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
from workbench.backends.spec import BackendFacts, BackendSpec, BackendTerms, on
from workbench.backends.step import all_sum
from workbench.checkpoints import canonical
from workbench.compute.optim import build_optimizer, build_scheduler
from workbench.config import rule
from workbench.config.rule import Rule
from workbench.config.schema import pick
from workbench.core.errors import missing_package
from workbench.models.build import rebuild_plain
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch
from workbench.train.distributed import ensure_process_group

TAG = "zero"  # DeepSpeed's own checkpoint tag in step directories from before the canonical format
READ_CHUNK_BYTES = 1 << 30  # full fp32 tensors a rank reads at once when loading (weights + moments)


@dataclass
class Config:
    name: str = "deepspeed"  # the backend; backend=deepspeed sets it
    stage: int = 3  # ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (stage 3 only)
    nvme_path: str = ""  # a directory on local NVMe, for offload_* = nvme
    pin_memory: bool = True  # offload buffers in pinned host memory: faster copies, that RAM locked
    overlap_comm: bool = True  # reduce gradients while the backward still runs
    contiguous_gradients: bool = True  # copy gradients into one contiguous buffer as they are produced (less fragmentation)
    # gradient elements reduced at once; this and the other bucket sizes are capped at the model's
    # parameter count (a larger bucket only wastes memory)
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000  # parameter elements all-gathered at once (stages 1 and 2)
    stage3_prefetch_bucket_size: int = 50_000_000  # stage 3: parameter elements fetched ahead of their use
    stage3_param_persistence_threshold: int = 100_000  # stage 3: parameters smaller than this stay whole on every rank
    stage3_max_live_parameters: int = 1_000_000_000  # stage 3: most gathered parameter elements a rank holds at once
    stage3_max_reuse_distance: int = 1_000_000_000  # stage 3: a parameter used again within this many elements stays gathered
    # sequence parallelism: ranks sharing every row's tokens. The workbench's own Ulysses
    # (workbench/train/sequence_parallel.py), not DeepSpeed's UlyssesSPAttentionHF: under SDPA that
    # one drops the attention mask (is_causal over the whole row), so packed documents would attend
    # to each other, and it needs heads divisible by sp and a fixed micro-batch size.
    sp: int = 1


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


def ds_config(cfg, tcfg, pol, max_grad_norm: float, n_params: int = 1 << 62, accum: int | None = None) -> dict:
    """The DeepSpeed JSON config from the workbench's config.

    Buckets are buffers of that many elements; one larger than the model only wastes memory
    (DeepSpeed allocates them whole), so they are capped at the number of parameters. `accum`:
    the resolved run's micro-batches per step (a resume at another world size keeps the global
    batch by changing it; workbench/resolve/derive.py), else train.grad_accum.
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
        "gradient_accumulation_steps": accum or tcfg.grad_accum,
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

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx

    # -- setup ---------------------------------------------------------------------------
    def wrap(self, model: torch.nn.Module, ctx) -> None:
        deepspeed = _import()

        ensure_process_group(ctx.device)
        deepspeed.init_distributed(dist_backend="nccl" if ctx.device == "cuda" else "gloo")
        self.model, self.pol = model, ctx.run.precision
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        sequence_parallel.start(self.cfg.sp, model)
        self.trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        optim_cfg, max_steps = ctx.cfg.optim, ctx.cfg.train.max_steps
        config = ds_config(self.cfg, ctx.cfg.train, self.pol, optim_cfg.max_grad_norm,
                           n_params=sum(p.numel() for p in model.parameters()), accum=ctx.run.batch.accum)
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
        for i, whole in enumerate(batch.micro):
            if batch.micro_seeds:
                torch.manual_seed(batch.micro_seeds[i])  # layout-free dropout (workbench/train/noise.py)
            with sequence_parallel.rows(whole) as micro:  # this rank's slice under backend.sp
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

    def forward_only(self, micro: dict, loss_fn) -> float:
        """Through the module and its ZeRO-3 hooks, in the parameters' dtype, as training runs it."""
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                loss_sum, _ = loss_fn(self.model, micro)
        finally:
            self.model.train(was)
        return float(loss_sum.detach().float())

    # -- state (workbench/checkpoints/canonical.py) ----------------------------------------------------
    def _named(self) -> list:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _moments(self) -> tuple[str, ...]:
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        return ("exp_avg", "exp_avg_sq") if isinstance(inner, torch.optim.Adam | torch.optim.AdamW) else ()

    def _flat_states(self) -> list[dict]:
        """The inner optimizer's state of each flat fp32 partition (one per param group)."""
        zo = self.engine.optimizer
        flats = zo.fp32_partitioned_groups_flat if self.cfg.stage == 3 else zo.single_partition_of_fp32_groups
        return [zo.optimizer.state[f] for f in flats if f in zo.optimizer.state]

    def canonical_state(self) -> dict:
        """Collective: every rank joins each parameter's gather; its owner keeps the CPU copy."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        states = self._flat_states()
        step = float(states[0]["step"]) if states and "step" in states[0] else 0.0
        out = {}
        for i, (n, p) in enumerate(self._named()):
            full = {"": safe_get_full_fp32_param(p)}
            for k in self._moments() if states else ():
                full[k] = safe_get_full_optimizer_state(p, k)
            if i % self.world != self.rank:
                continue
            c = canonical.canonical_name(n)
            out[f"model/{c}"] = full[""].detach().float().cpu().clone()
            for k in self._moments() if states else ():
                out[f"optim/{c}/{k}"] = full[k].detach().float().cpu().clone()
                out[f"optim/{c}/step"] = torch.tensor(step)
        return out

    def _init_optimizer_state(self) -> None:
        """A fresh engine has no Adam state until its first step (ZeRO-1/2 link each parameter's
        fragment of it only then): create it, zero, and link the fragments, so that
        safe_set_full_optimizer_state has somewhere to write. The linking call is DeepSpeed's own
        (private) step-time initialiser; tests/unit/test_resume.py names it if it disappears."""
        zo = self.engine.optimizer
        flats = zo.fp32_partitioned_groups_flat if self.cfg.stage == 3 else zo.single_partition_of_fp32_groups
        for f in flats:
            if not zo.optimizer.state.get(f):
                zo.optimizer.state[f] = {"step": torch.tensor(0.0), **{k: torch.zeros_like(f) for k in self._moments()}}
        if self.cfg.stage != 3:
            zo._lazy_init_hp_params_optimizer_state()

    def load_canonical(self, read) -> None:
        """Every rank reads the full tensors of a chunk of parameters and keeps its fragment: the
        fp32 master and moments (DeepSpeed's setters write this rank's part only), and the
        low-precision copy the forward uses (ZeRO-3: gathered, written by rank 0, re-partitioned)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        moments = self._moments()
        if moments:
            self._init_optimizer_state()
        steps = set()
        for chunk in _chunks(self._named(), self.cfg.stage, READ_CHUNK_BYTES // (4 * (1 + len(moments)))):
            want = {}
            for n, p in chunk:
                c, shape = canonical.canonical_name(n), tuple(p.ds_shape) if self.cfg.stage == 3 else tuple(p.shape)
                want[f"model/{c}"] = torch.empty(shape, dtype=torch.float32)
                for k in moments:
                    want[f"optim/{c}/{k}"] = torch.empty(shape, dtype=torch.float32)
                if moments:
                    want[f"optim/{c}/step"] = torch.tensor(0.0)
            read(want)
            for n, p in chunk:
                c = canonical.canonical_name(n)
                w = want[f"model/{c}"]
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=self.cfg.stage == 3):
                    if self.cfg.stage != 3 or self.rank == 0:
                        p.data.copy_(w.view(p.shape).to(p.dtype))
                safe_set_full_fp32_param(p, w.to(p.device))
                for k in moments:
                    safe_set_full_optimizer_state(p, want[f"optim/{c}/{k}"].to(p.device), k)
                    steps.add(float(want[f"optim/{c}/step"]))
        if len(steps) > 1:
            raise RuntimeError(f"deepspeed: the checkpoint's parameters have different optimizer steps {sorted(steps)}")
        for state in self._flat_states() if steps else ():  # one step count per flat partition
            state["step"] = torch.tensor(next(iter(steps)))

    def schedule_state(self) -> dict:
        return canonical.schedule_state(self.scheduler)

    def load_schedule(self, state: dict) -> None:
        canonical.apply_schedule(self.scheduler, self.optimizer, state)

    def load_legacy(self, path: Path, rank: int) -> None:
        """DeepSpeed's own checkpoint (zero/), at the same stage and world size."""
        load_path, _ = self.engine.load_checkpoint(str(path), tag=TAG, load_module_strict=False,
                                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise RuntimeError(f"deepspeed: no checkpoint under {path}/{TAG}")

    def gathered_model(self):
        """Collective: a plain copy of the trained model with full weights on rank 0, None elsewhere."""
        import deepspeed


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


def _chunks(named: list, stage: int, elements: int):
    """Consecutive runs of parameters of at most `elements` elements each (at least one each)."""
    chunk, size = [], 0
    for n, p in named:
        numel = int(p.ds_numel) if stage == 3 else p.numel()
        if chunk and size + numel > elements:
            yield chunk
            chunk, size = [], 0
        chunk.append((n, p))
        size += numel
    if chunk:
        yield chunk


def build(cfg, ctx) -> DeepSpeedBackend:
    return DeepSpeedBackend(cfg, ctx)


def _offloads(c) -> tuple[str, str]:
    return pick(c, "backend.offload_optimizer", "none"), pick(c, "backend.offload_param", "none")


RULES = (
    Rule("qlora-zero3-checkpointing", {"peft": "qlora", "backend": "deepspeed stage 3",
                                       "other": "gradient checkpointing"},
         lambda c, e: rule.peft(c) == "qlora" and rule.stage(c) == 3 and c.model.gradient_checkpointing,
         "peft=qlora with ZeRO-3 and model.gradient_checkpointing is not supported; use backend=fsdp2 with "
         "backend.activation_checkpointing=full"),
    Rule("deepspeed-fp8", {"backend": "deepspeed", "precision": "fp8"},
         lambda c, e: rule.precision(c) == "fp8",
         "precision=fp8 is not supported with backend=deepspeed; use precision=bf16-mixed, or backend=fsdp2 for fp8"),
    Rule("deepspeed-stage", {"backend": "deepspeed"},
         lambda c, e: rule.stage(c) not in (1, 2, 3),
         lambda c, e: f"backend.stage={rule.stage(c)}: ZeRO stages are 1, 2 or 3; for plain data parallelism "
                      f"use backend=single"),
    Rule("deepspeed-offload-choice", {"backend": "deepspeed", "offload": "optimizer, params"},
         lambda c, e: any(o not in ("none", "cpu", "nvme") for o in _offloads(c)),
         lambda c, e: f"config fields 'backend.offload_optimizer' / 'backend.offload_param' must be none, cpu or nvme "
                      f"(got {pick(c, 'backend.offload_optimizer', 'none')!r} / {pick(c, 'backend.offload_param', 'none')!r})"),
    Rule("param-offload-needs-zero3", {"backend": "deepspeed stage < 3", "offload": "params"},
         lambda c, e: _offloads(c)[1] != "none" and rule.stage(c) != 3,
         "backend.offload_param needs parameters partitioned: set backend.stage=3 (stages 1-2 keep full "
         "parameters on every rank)"),
    Rule("nvme-offload-needs-path", {"backend": "deepspeed", "offload": "nvme"},
         lambda c, e: "nvme" in _offloads(c) and not os.path.isdir(str(pick(c, "backend.nvme_path", "") or "")),
         lambda c, e: "backend.offload_*=nvme needs an existing directory on local NVMe: set backend.nvme_path "
                      f"(got {pick(c, 'backend.nvme_path', '')!r})", machine=True),
    Rule("deepspeed-needs-package", {"backend": "deepspeed"},
         lambda c, e: not e.has("deepspeed"),
         "backend=deepspeed needs deepspeed: pip install -e '.[deepspeed]' (or use backend=fsdp2)", machine=True),
)

def terms(node) -> BackendTerms:
    """The planner's terms: the ZeRO stage, and offload_optimizer / offload_param (cpu or nvme:
    off the device either way)."""
    stage = getattr(node, "stage", None)
    return BackendTerms(stage=None if stage is None else int(stage),
                        offload_optimizer=on(getattr(node, "offload_optimizer", False)),
                        offload_params=on(getattr(node, "offload_param", False)))


SPEC = BackendSpec(name="deepspeed", config=Config, build=build, rules=RULES, terms=terms,
                   facts=BackendFacts(shards_from_stage=3, own_accumulation=True, needs_launcher=True, half_compute=True,
                                      master_weights=True, fused_optimizer=True,
                                      optimizer_offload="offload_optimizer", loads_4bit=True,
                                      untraced="DeepSpeed's ZeRO engine allocates its flat buffers and partitions "
                                               "through its own C++/CUDA ops and its communication layer, which "
                                               "neither fake tensors nor torch's fake process group reach"))
