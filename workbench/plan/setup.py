"""What the planner reads from a run config, in one flat record.

Precision, peft, the reference strategy and the parallel layout come from the resolved run
(workbench/resolved.py); fields owned by one backend or method (stage, offload, generations) are
read by their schema names with defaults, so the planner works for any backend or method config.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omegaconf import OmegaConf

from workbench.catalog import facts as method_facts
from workbench.resolved import derive


def pick(cfg, keys, default):
    """The first of `keys` that is set in cfg, else default."""
    for key in [keys] if isinstance(keys, str) else keys:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class Setup:
    method: str = "sft"
    peft: str = "none"  # none | lora | qlora | dora
    lora_r: int = 16
    double_quant: bool = True
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    backend: str = "single"
    stage: int = 0  # ZeRO stage (deepspeed); fsdp2 behaves like 3
    offload_optimizer: bool = False
    offload_params: bool = False
    devices: int = 1  # all devices the run uses
    device: str = "cuda"  # cpu | cuda | ... (torch's optimizers loop per tensor on CPU, foreach on GPU)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"  # none | full | selective (every checkpoint_every-th block)
    checkpoint_every: int = 2
    select_fraction: float = 1.0  # share of positions whose logits a loss needs
    dpo_ref: str = "adapter"  # reference model: adapter | copy | precompute | none (resolved.reference)
    teacher_scale: float = 1.0  # distillation: teacher parameters / student parameters
    generations: int = 8  # GRPO group size
    completion_len: int = 256
    vllm_fraction: float = 0.0  # GPU memory share reserved by a colocated vLLM engine (0: HF generate)

    @property
    def dp(self) -> int:
        return max(1, self.devices // (self.tp * self.pp * self.cp))

    @property
    def shards_params(self) -> bool:
        return self.backend == "fsdp2" or (self.backend == "deepspeed" and self.stage >= 3)

    def but(self, **kw) -> Setup:
        return replace(self, **kw)


def _flag(value) -> bool:
    if isinstance(value, str):
        return value.lower() not in ("", "none", "false", "no", "0")
    return bool(value)


def from_cfg(cfg, devices: int | None = None) -> Setup:
    """Fields by their schema names (a backend or method without one gets the default)."""
    backend = pick(cfg, "backend.name", "single")
    stage = int(pick(cfg, "backend.stage", 3 if backend == "fsdp2" else 0))
    ckpt = pick(cfg, "backend.activation_checkpointing" if backend != "megatron" else "backend.recompute", None)
    if ckpt is None or not _flag(ckpt):
        ckpt = "full" if cfg.model.gradient_checkpointing else "none"
    elif ckpt not in ("selective",):
        ckpt = "full"
    method = pick(cfg, "method.name", "sft")
    use_vllm = method_facts(method).generates and pick(cfg, "method.engine", "hf") == "vllm"
    run = derive(cfg)  # precision, peft and the reference strategy, as the run will have them
    ref = {"precomputed": "precompute"}.get(run.reference, run.reference)
    host = _flag(pick(cfg, "backend.cpu_offload", False))  # fsdp2: parameters, gradients and optimizer state
    return Setup(
        method=method, peft=run.peft.kind, lora_r=int(cfg.peft.r), double_quant=bool(cfg.peft.double_quant),
        precision=run.precision.name, optimizer=cfg.optim.name, backend=backend, stage=stage,
        offload_optimizer=host or _flag(pick(cfg, "backend.offload_optimizer", False)),
        offload_params=host or _flag(pick(cfg, "backend.offload_param", False)),
        devices=devices or cfg.hardware.procs * cfg.hardware.nodes, device=cfg.hardware.device,
        tp=run.layout.tp, pp=run.layout.pp, cp=run.layout.cp, ep=int(pick(cfg, "backend.ep", 1)),
        micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum, seq_len=cfg.data.seq_len,
        checkpointing=ckpt, checkpoint_every=int(pick(cfg, "backend.selective_every", 2)),
        select_fraction=float(pick(cfg, "plan.select_fraction", 1.0)),
        dpo_ref=ref, teacher_scale=float(pick(cfg, "plan.teacher_scale", 1.0)),
        generations=int(pick(cfg, "method.num_generations", 8)),
        completion_len=int(pick(cfg, "method.max_new_tokens", 256)),
        vllm_fraction=float(pick(cfg, "method.vllm_gpu_memory_utilization", 0.3)) if use_vllm else 0.0,
    )
