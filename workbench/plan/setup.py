"""What the planner reads from a run config, in one flat record (made by plan/make.py from_cfg)."""

from __future__ import annotations

from dataclasses import dataclass, replace


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
    distributed_optimizer: bool = False  # megatron: Megatron-Core's optimizer, state sharded over data-parallel ranks
    # megatron: the runner's HF model keeps its weights on every device beside the GPTModel shards
    # (run.keeps_hf_base: a full fine-tune, generation, a copied or precomputed reference)
    hf_copy: bool = False

    @property
    def dp(self) -> int:
        return max(1, self.devices // (self.tp * self.pp * self.cp))

    @property
    def shards_params(self) -> bool:
        return self.backend == "fsdp2" or (self.backend == "deepspeed" and self.stage >= 3)

    def but(self, **kw) -> Setup:
        return replace(self, **kw)
