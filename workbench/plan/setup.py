"""What the planner sizes, in one flat record: a view of the resolved run (workbench/resolve/derive.py)
and of the specs' facts (a method's Rollouts, a backend's BackendFacts), made by plan/make.py
from_cfg; the memory and speed models (plan/memory.py, plan/speed.py) read only this."""

from __future__ import annotations

from dataclasses import dataclass, replace

from workbench.backends import registry as backends
from workbench.backends.spec import BackendFacts
from workbench.peft.kind import Peft
from workbench.train.layout import Layout


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
    # TP ranks split the tokens of what they replicate too (BackendTerms.tp_splits_tokens); else
    # each holds every token of the norms, the residual stream and the linears' inputs
    tp_splits_tokens: bool = True
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 2048
    checkpointing: str = "none"  # none | full | selective (every checkpoint_every-th block)
    checkpoint_every: int = 2
    # the backend's accumulation sync option, where its facts name one (accumulation_sync_field):
    # auto | true | false, decided with the parameter counts (workbench/backends/spec.py)
    accum_sync: str = "auto"
    select_fraction: float = 1.0  # share of positions whose logits a loss needs
    loss_chunk: int = 0  # model.loss_chunk: positions per checkpointed piece of the head; 0: all at once
    packed: bool = False  # data.packing: rows of several documents, attended through a (seq x seq) mask
    dpo_ref: str = "adapter"  # reference model: adapter | copy | precompute | none (resolved.reference)
    teacher_scale: float = 1.0  # distillation: teacher parameters / student parameters
    generations: int = 0  # completions per prompt (from_cfg: the method spec's Rollouts)
    completion_len: int = 0  # tokens a completion may take (from_cfg: the method spec's Rollouts)
    # rollouts (a method whose spec generates: workbench/methods/spec.py Rollouts): each rank generates its whole
    # groups at once, `rollout_prompts` prompts x `generations` completions, once every
    # `num_iterations` optimizer steps; with `share_prompt` a micro-batch's completions of one
    # prompt are one row (the prompt once, the completions as branches)
    rollouts: bool = False
    rollout_prompts: int = 1
    num_iterations: int = 1
    share_prompt: bool = False
    old_logps: bool = False  # a forward pass for the generating policy's log-probs (no gradient)
    vllm_fraction: float = 0.0  # GPU memory share reserved by a colocated vLLM engine (0: HF generate)
    rollout_overlaps: bool = False  # the rollout generates while the step trains (async), not before it
    distributed_optimizer: bool = False  # megatron: Megatron-Core's optimizer, state sharded over data-parallel ranks
    # megatron: the runner's HF model keeps its weights on every device beside the GPTModel shards
    # (run.keeps_hf_base: a full fine-tune, generation, a copied or precomputed reference)
    hf_copy: bool = False

    @property
    def adapter(self) -> bool:
        """Trains adapters (lora, qlora, dora), the base frozen."""
        return Peft(self.peft).adapter

    @property
    def quantised(self) -> bool:
        """The frozen base in NF4 (qlora)."""
        return Peft(self.peft).quantised

    @property
    def dora(self) -> bool:
        return Peft(self.peft).dora

    @property
    def layout(self) -> Layout:
        return Layout(world=self.devices, tp=self.tp, pp=self.pp, cp=self.cp, sp=self.sp)

    @property
    def dp(self) -> int:
        """Ranks that hold the same model slice: what sharding (ZeRO, FSDP2) divides over."""
        return self.layout.replicas

    @property
    def data_parallel(self) -> int:
        """Ranks that take their own rows of the global batch."""
        return self.layout.dp

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
