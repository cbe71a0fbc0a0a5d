"""What the planner reads from a run config, in one flat record (made by run/plan.py from_cfg)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from workbench.backends import registry as backends
from workbench.backends.spec import BackendFacts


@dataclass(frozen=True)
class Setup:
    method: str = "sft"
    peft: str = "none"  # none | lora | qlora | dora
    lora_r: int = 16
    double_quant: bool = True
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    backend: str = "single"
    stage: int | None = None  # backend.stage (DeepSpeed's ZeRO stage); None: the backend's default (FSDP2: 3)
    offload_optimizer: bool = False
    offload_params: bool = False
    devices: int = 1  # all devices the run uses
    device: str = "cuda"  # cpu | cuda | ... (torch's optimizers loop per tensor on CPU, foreach on GPU)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: int = 1  # backend.sp: ranks sharing every row's tokens (workbench/train/sequence_parallel.py)
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"  # none | full | selective (every checkpoint_every-th block)
    checkpoint_every: int = 2
    select_fraction: float = 1.0  # share of positions whose logits a loss needs
    loss_chunk: int = 0  # model.loss_chunk: positions per checkpointed piece of the head; 0: all at once
    packed: bool = False  # data.packing: rows of several documents, attended through a (seq x seq) mask
    dpo_ref: str = "adapter"  # reference model: adapter | copy | precompute | none (resolved.reference)
    teacher_scale: float = 1.0  # distillation: teacher parameters / student parameters
    generations: int = 8  # GRPO group size
    completion_len: int = 256
    # GRPO-family rollouts (a method config with num_generations): each rank generates its whole
    # groups at once, `rollout_prompts` prompts x `generations` completions, once every
    # `num_iterations` optimizer steps; with `share_prompt` a micro-batch's completions of one
    # prompt are one row (the prompt once, the completions as branches)
    rollouts: bool = False
    rollout_prompts: int = 1
    num_iterations: int = 1
    share_prompt: bool = False
    old_logps: bool = False  # a forward pass for the generating policy's log-probs (no gradient)
    vllm_fraction: float = 0.0  # GPU memory share reserved by a colocated vLLM engine (0: HF generate)
    distributed_optimizer: bool = False  # megatron: Megatron-Core's optimizer, state sharded over data-parallel ranks
    # megatron: the runner's HF model keeps its weights on every device beside the GPTModel shards
    # (run.keeps_hf_base: a full fine-tune, generation, a copied or precomputed reference)
    hf_copy: bool = False

    @property
    def dp(self) -> int:
        """Ranks that hold the same model slice: what sharding (ZeRO, FSDP2) divides over. The sp
        ranks of backend.sp are among them (they shard like data-parallel replicas)."""
        return max(1, self.devices // (self.tp * self.pp * self.cp))

    @property
    def data_parallel(self) -> int:
        """Ranks that take their own rows of the global batch: dp over the sp ranks sharing a row."""
        return max(1, self.dp // self.sp)

    @property
    def facts(self) -> BackendFacts:
        """What the backend holds and can do (workbench/backends/spec.py)."""
        return backends.spec(self.backend).facts

    @property
    def zero_stage(self) -> int:
        """What is sharded over the data-parallel ranks, as a ZeRO stage (1: optimizer state and
        master weights, 2: also gradients, 3: also parameters). Megatron-Core's distributed
        optimizer shards its main weights and moments: stage 1."""
        if self.distributed_optimizer:
            return 1
        return self.facts.default_stage if self.stage is None else self.stage

    @property
    def shards_params(self) -> bool:
        return self.facts.shards(self.zero_stage)

    def but(self, **kw) -> Setup:
        return replace(self, **kw)
