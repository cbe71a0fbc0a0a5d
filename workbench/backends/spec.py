"""What a backend is, for the rest of the workbench: its spec.

Every backend module (workbench/backends/<name>.py) ends with one `SPEC = BackendSpec(...)`: its
name, its options dataclass (`Config`), its builder, the facts other layers read without running
it (whether it shards parameters, what the planner counts for it), the function that turns its
options into the planner's terms (`terms`: BackendTerms) and the rules that concern it alone.
`workbench/backends/registry.py` gathers the specs: it is the only list of backends, read by the
rule table (workbench/resolve/rules.py), the resolved run and the planner (workbench/plan/), none of
which compares a backend's name (tests/unit/test_layout.py) or reads a backend option by name
(tests/unit/test_option_reads.py): they read the facts and the terms.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass

# Trainable parameters, as a share of all the model's, up to which a sharding backend's `auto`
# accumulation skips the gradient reduce-scatter before the last micro-batch (below).
SMALL_TRAINABLE_SHARE = 0.05


def syncs_each_micro_batch(choice, trainable: float, total: float) -> bool:
    """Whether a sharding backend reduce-scatters gradients after every micro-batch of a step
    (`choice`: its option, auto | true | false; `trainable`/`total`: parameter counts).

    Skipping the sync keeps each rank's gradients unsharded, and in the reduce dtype, until the
    last micro-batch: the whole model's fp32 gradient on every rank under full fine-tuning (262.8
    GiB at 70B, three times the sharded weights, grads and optimizer together at 8 ranks), to
    save (grad_accum - 1) reduce-scatters that overlap the backward anyway. So `auto` reduces
    every micro-batch, as torchtitan does, unless what trains is small: adapters (LoRA r=64 on
    every linear layer of Llama 3 8B is 2% of its parameters), whose unsharded gradients are a
    fraction of a GiB and whose many small reduce-scatters are latency, not bandwidth."""
    value = str(choice).lower()
    if value in ("true", "false"):
        return value == "true"
    return trainable > SMALL_TRAINABLE_SHARE * max(total, 1.0)


@dataclass(frozen=True)
class BackendFacts:
    """What the rest of the workbench knows about a backend without building it."""

    default_stage: int = 0  # the sharding stage when backend.stage is not set (FSDP2 always shards: 3)
    shards_from_stage: int | None = None  # parameters are sharded at this stage and above; None: never
    loads_unsloth: bool = False  # model.loader=unsloth's patched single-GPU model trains under it
    own_accumulation: bool = False  # counts accumulation boundaries from its own config (train.grad_accum)
    # only runs inside a launched process (DeepSpeed's engine needs LOCAL_RANK): torchrun starts
    # it even on one process (workbench/launch/dispatch.py)
    needs_launcher: bool = False
    model_parallel: bool = False  # splits the model itself (tp/pp/ep), with its own layers and checkpoint field
    # -- planner terms (workbench/plan/): what the memory estimate counts and the fixes it may
    # suggest; the resolved run and the FLOP count read the last ones too
    # its modules see their weights in the compute dtype (DeepSpeed's and Megatron's half-precision
    # parameters, FSDP2's MixedPrecisionPolicy all-gathers), not torch.autocast's per-Linear
    # casts: sets what the blocks save for backward and whether autocast's weight copies exist
    half_compute: bool = False
    # keeps half-precision parameters and gradients beside fp32 master weights in its optimizer
    # (DeepSpeed's bf16/fp16 engine): 2 + 2 bytes per parameter plus a 4-byte master copy
    master_weights: bool = False
    # steps with a fused Adam kernel, which makes none of torch AdamW's parameter-sized temporaries
    fused_optimizer: bool = False
    # re-gathers the root unit (embeddings, head) for the head's backward after resharding it
    # after forward (FSDP2): the all-gather buffer and its copy-out are alive at once
    regathers_root: bool = False
    # The next three name options for the overrides the planner suggests (workbench/plan/fit.py);
    # their values reach the planner through the spec's `terms`, never by these names.
    # the backend option that turns on activation checkpointing (none | full | selective);
    # None: model.gradient_checkpointing alone decides
    checkpointing_field: str | None = None
    # the option (auto | true | false: syncs_each_micro_batch above) that says whether gradients
    # are reduce-scattered after every micro-batch; where they are not, the planner counts each
    # rank's unsharded gradients through the step. None: the backend holds no unsharded ones
    accumulation_sync_field: str | None = None
    # the option that moves only the optimizer state (and master weights) to host memory, which
    # the planner names when suggesting offload; None: the backend has no such option
    optimizer_offload: str | None = None
    loads_4bit: bool = False  # trains over bitsandbytes 4-bit base weights (peft=qlora) in its layers
    # why dry_run=trace cannot run its step on fake tensors over torch's fake process group
    # (workbench/plan/trace.py); None: it can. `untraced_over_processes`: the same, for a run of
    # more than one process only
    untraced: str | None = None
    untraced_over_processes: str | None = None
    untraced_with_experts: str | None = None  # the same, for a mixture-of-experts model
    untraced_generating: str | None = None  # the same, for a method that generates (GRPO)
    # its output layer projects every position (Megatron's GPTModel), not only those a loss reads:
    # the logits' memory and the head's FLOPs follow the whole batch
    head_every_position: bool = False
    # gathers the selected logits over tensor-parallel ranks for the method's own log-softmax
    # (a vocabulary-parallel loss, distillation's, keeps 1/tp of them)
    gathers_logits: bool = False
    # bridges the runner's HF model into modules of its own: the HF model may be released to the
    # host or stay whole beside them (run.keeps_hf_base), and a reference or teacher stays a whole
    # HF model on every device rather than a shard
    bridges_hf_model: bool = False
    # its rotary embeddings take positions 0..T-1 only (Megatron's), so padding-free packed rows,
    # which restart positions per example, cannot train under it
    fixed_positions: bool = False

    def shards(self, stage: int | None = None) -> bool:
        """Whether parameters are sharded at `stage` (backend.stage; None: the backend's default,
        where its options have no stage). The one test of it: the resolved run, the rules and the
        planner ask here."""
        stage = self.default_stage if stage is None else stage
        return self.shards_from_stage is not None and stage >= self.shards_from_stage


def on(value) -> bool:
    """An option's value as a switch: `none`, `false`, `no`, `0` and the empty string are off,
    so `offload_optimizer: cpu` and `cpu_offload: true` both turn it on."""
    if isinstance(value, str):
        return value.lower() not in ("", "none", "false", "no", "0")
    return bool(value)


def checkpointing(value) -> str | None:
    """A backend's activation checkpointing option (none | full | selective, or a switch) as the
    planner counts it: `selective`, `full` (any other value that is on), None where it is off."""
    if value is None or not on(value):
        return None
    return "selective" if value == "selective" else "full"


@dataclass(frozen=True)
class BackendTerms:
    """A backend's options in the planner's terms: what they do, not what they are called. Each
    backend module maps its own options (`BackendSpec.terms`); the planner (workbench/plan/make.py,
    workbench/plan/), the resolved run and resume read these, so a backend with its own offload,
    parallel or checkpointing options adds no planner code. The defaults are a backend without
    such options."""

    stage: int | None = None  # the ZeRO stage its options set; None: it has no stage option (facts.default_stage)
    offload_optimizer: bool = False  # optimizer state (and master weights) kept in host memory
    offload_params: bool = False  # parameters kept in host memory
    ep: int = 1  # expert parallelism: ranks splitting a mixture-of-experts model's experts
    # activation checkpointing its own option turns on (full | selective, every `checkpoint_every`-th
    # block); None: model.gradient_checkpointing alone decides
    checkpointing: str | None = None
    checkpoint_every: int = 2
    # auto | true | false (syncs_each_micro_batch above), as the option is written (str() of it):
    # whether gradients are reduce-scattered after every micro-batch
    accum_sync: str = "auto"
    distributed_optimizer: bool = False  # Megatron-Core's optimizer: state sharded over data-parallel ranks
    # tensor parallelism also splits the tokens of what it replicates (the norms, the residual
    # stream, the column-parallel linears' inputs): Megatron-Core's sequence parallelism
    tp_splits_tokens: bool = False


def no_terms(node) -> BackendTerms:
    """The terms of a backend without options the planner counts (backend=single)."""
    return BackendTerms()


@dataclass(frozen=True)
class BackendSpec:
    name: str
    config: type  # the options dataclass; conf/backend/<name>.yaml composes onto it
    build: Callable  # (backend config, Context) -> a Backend (workbench/backends/base.py)
    facts: BackendFacts = field(default_factory=BackendFacts)
    rules: tuple = ()  # workbench/config/rule.py Rules that concern this backend alone
    # (its options node: cfg.backend, a Config, or None where the config has none) -> BackendTerms
    terms: Callable = no_terms

    def __post_init__(self):
        """A half-made spec is an error where it is written, at import, not a fallback later."""
        if not (is_dataclass(self.config) and self.config().name == self.name and callable(self.build)
                and callable(self.terms)):
            raise TypeError(f"backend spec {self.name!r}: config must be a dataclass whose name defaults to "
                            f"{self.name!r}, and build and terms callables")
