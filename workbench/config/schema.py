"""Typed schemas for every config group: the dataclasses Hydra composes onto.

Each YAML of a schema-backed group (conf/<group>/) starts with `defaults: [_schema, _self_]`, so
Hydra composes it onto the dataclass here; an unknown key (`optim.lrr`) or a wrong type
(`optim.lr=abc`) fails while it composes. Method and backend options live beside their code
(`workbench/methods/<name>.py`, `workbench/backends/<name>.py`, each with a `Config` dataclass,
registered in `workbench/methods/registry.py` and `workbench/backends/registry.py`).
`workbench/resolve/validate.py` applies all of them to a composed config.

Run `python -m workbench --cfg job` to see the composed config.

`pick(cfg, "backend.stage", 0)` reads a field one backend or method owns by its schema name, with
a default for the configs that have no such field (the rule table and the planner read them so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf


def job_dir(default: str) -> str:
    """`output_dir` under Hydra: the job's sweep subdir in multirun, else `default`."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:
        return default
    if not HydraConfig.initialized():
        return default
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        out = OmegaConf.select(hc, "runtime.output_dir", default=None)
        if out:
            return str(out)
    return default


def pick(cfg, keys, default):
    """The first of `keys` (a dotted name, or a list of them) that is set in cfg, else default."""
    for key in [keys] if isinstance(keys, str) else keys:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None:
            return value
    return default


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("workbench.job_dir"):
        OmegaConf.register_new_resolver("workbench.job_dir", job_dir)


# conf/train.yaml's output_dir goes through ${workbench.job_dir:...}: each multirun job trains in
# its own sweep subdir.
register_resolvers()


@dataclass
class ArchConfig:
    """Architecture numbers: enough to build the model on the meta device and plan it."""

    family: str = "llama"  # llama | qwen2 | qwen3 | mixtral
    layers: int = 2  # decoder blocks
    hidden: int = 64  # model width (hidden size)
    heads: int = 4  # attention (query) heads
    kv_heads: int = 4  # key/value heads; fewer than heads: grouped-query attention
    head_dim: int | None = None  # width of one attention head; null: hidden / heads
    intermediate: int = 128  # inner width of each MLP (of each expert in a MoE)
    vocab: int = 49152  # vocabulary size: rows of the embedding and the output head
    max_position: int = 2048  # longest context in tokens; data.seq_len may not exceed it
    experts: int = 0  # MoE: experts per layer (0 = dense)
    experts_per_token: int = 0  # MoE: experts each token is routed to (top-k)
    tie_embeddings: bool = True  # the output head shares the input embedding's weights
    rope_theta: float = 10000.0  # RoPE base frequency
    rms_norm_eps: float = 1e-5  # epsilon added to the mean square in RMSNorm


@dataclass
class ModelConfig:
    # the conf/model/ entry, or a label for a model given by path or hub_id; tiny (or no hub_id,
    # path and gguf_package at all): random weights built from `arch`
    name: str = "smollm2-135m"
    # Where weights come from: `hub_id` (HF cache, then hub), `path` (a local HF dir wins over
    # hub_id), `gguf_package` (a Python package shipping a .gguf file), or `tiny` (random init
    # from `arch`, fixed seed; no weights at all).
    hub_id: str | None = None
    path: str | None = None  # a local HF model directory (with config.json): the only place weights are read from
    # a Python package shipping a .gguf of the weights, dequantised once into $WORKBENCH_CACHE;
    # read when the HF cache has no copy, before the hub is asked
    gguf_package: str | None = None
    tokenizer: str | None = None  # a model name or dir whose tokenizer to use (tiny borrows one)
    init_seed: int = 0  # seed of the random weights of a model built from `arch` (model=tiny)
    loader: str = "hf"  # hf | unsloth
    # sdpa | eager | flash_attention_2 | flash_attention_3 (both CUDA + flash-attn) | auto
    # (flash_attention_2 on a GPU that has flash-attn installed, else sdpa)
    attn_implementation: str = "sdpa"
    # recompute each decoder block's activations in the backward: less activation memory for
    # about one more forward per step
    gradient_checkpointing: bool = False
    # positions per piece of the head and log-softmax when a loss reads target log-probs; each
    # piece is recomputed in the backward, so the (positions x vocabulary) logits never exist at
    # once (workbench/models/head.py). 0: the run chooses: 512 where one micro-batch's logits at
    # once would pass 4 GiB (Gemma 3's 262,144-token vocabulary), else all positions in one piece
    loss_chunk: int = 0
    trust_remote_code: bool = False  # run the model repository's own Python code (config, tokenizer, model)
    arch: ArchConfig = field(default_factory=ArchConfig)
    # Set by validation, not by hand: the config.json that `arch` was read from when the model is
    # given by path or by a hub id of its own (workbench/models/auto.py); null for catalog entries.
    arch_from: str | None = None


@dataclass
class PeftConfig:
    kind: str = "none"  # none | lora | qlora | dora
    r: int = 16  # adapter rank: the width of each A x B bottleneck
    alpha: int = 32  # the adapter's output is scaled by alpha / r
    dropout: float = 0.0  # dropout on each adapter's input while training; 0: none (backend=megatron needs 0)
    # "all-linear" = every Linear in the decoder blocks; or an explicit list of module names.
    target_modules: Any = "all-linear"
    # QLoRA: frozen base weights stored as NF4 with double-quantised constants.
    quant_type: str = "nf4"  # nf4 | fp4 (bitsandbytes' 4-bit types); peft=qlora only
    double_quant: bool = True  # quantise the 4-bit blocks' scale constants too: about 0.4 bits less per weight
    # The dtype the packed 4-bit weights are stored in. uint8 is bitsandbytes' default; FSDP
    # needs a float dtype it can shard (accelerate#3983), so backends may override it.
    quant_storage: str = "uint8"


@dataclass
class DataConfig:
    recipe: str | None = None  # data_recipes/<recipe>.yaml; null: the method's own (method.recipe)
    seq_len: int = 256  # tokens per example at most (prompt + completion); longer ones are truncated
    packing: bool = False
    # SFT: a micro-batch whose examples fit in fewer rows is packed into them (same examples,
    # same loss, no compute on padding; workbench/data/packing.py pad_free)
    pad_free: bool = True
    # SFT: a micro-batch whose examples start with the same tokens reads them once, as one tree
    # row (workbench/data/pair_tree.py prefix_tree), where that saves >= 20% of its tokens; SDPA only
    share_prefix: bool = False
    chat_template: str | None = None  # a named override; default: the tokenizer's own
    shuffle_seed: int = 1234  # the order training rows are drawn in (kept apart from train.seed)
    on_bad_row: str = "error"  # error | skip
    preview: bool = False
    preview_samples: int = 3  # samples data.preview=true prints
    pack_len: int = 0  # tokens per packed row (0 = seq_len); must be >= seq_len
    cache: bool = True  # reuse tokenised sources by fingerprint (workbench/data/cache.py)
    cache_dir: str | None = None  # default: $WORKBENCH_CACHE/tokenised
    # One file (or a list of files) instead of a recipe; validation turns it into an inline
    # recipe held in `recipe` (workbench/data/recipes.py).
    path: Any = None
    format: str = "auto"  # the format of data.path's files (auto-detected per row by default)
    # Held-out rows: a fraction (0.05), a row count (200) or a file; never trained on.
    eval_split: Any = None
    # Training rows whose key a held-out row shares leave training: `package.module:function`
    # (row -> key); null: the exact prompt (workbench/data/recipes.py)
    dedup_key: str | None = None


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 2e-4  # peak learning rate, reached at the end of warmup
    weight_decay: float = 0.0  # decoupled weight decay (AdamW; SGD: L2); 0: none
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's moment decay rates [beta1, beta2]
    eps: float = 1e-8  # AdamW's epsilon in the update's denominator
    max_grad_norm: float = 1.0
    scheduler: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 5  # lr rises linearly from lr / warmup_steps to lr over these steps; 0: no warmup
    min_lr_ratio: float = 0.1  # linear and cosine decay towards min_lr_ratio x lr, reached at max_steps


@dataclass
class PrecisionConfig:
    # fp32 | bf16 (pure bf16 weights and optimizer) | bf16-mixed (fp32 master weights,
    # bf16 autocast) | fp16 (fp16 autocast with dynamic loss scaling) | fp8 (GPU only) | auto
    # (bf16-mixed where the device has bf16 arithmetic, else fp32: precision.choose)
    name: str = "auto"


@dataclass
class TrainConfig:
    max_steps: int = 100  # optimizer steps the run trains
    # examples per forward/backward on each rank (preference methods: pairs; grpo: completions)
    micro_batch_size: int = 16
    grad_accum: int = 1
    # seeds torch, numpy and random before the model is built (adapter init, dropout) and keys the
    # sampling noise of methods that generate; the data order is data.shuffle_seed
    seed: int = 0
    log_every: int = 10  # a progress line on stdout every N steps; metrics.jsonl and the trackers get every step
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2  # the newest N step checkpoints are kept, older ones deleted; 0: keep all
    resume: str = "auto"  # auto (latest in output_dir, if any) | never | <checkpoint dir>
    # Resuming at another world size keeps the checkpoint's global batch by recomputing grad_accum
    # (workbench/checkpoints/resume.py); false: this run's micro x accum x ranks is the new global batch.
    keep_global_batch: bool = True
    # The replay certificate on every resume (workbench/checkpoints/replay.py): error stops a run whose
    # loaded weights do not reproduce the saved probe loss; warn reports it and goes on.
    resume_check: str = "error"
    # A resume whose config changes what the run computes (optimizer, schedule, data, model,
    # method, precision, seed; workbench/checkpoints/resume_changes.py) is refused naming each change;
    # allow: it continues, and the changes are recorded in manifest.json and report.md.
    resume_changes: str = "refuse"
    export: bool = True
    # export/merged: full safetensors weights (adapters merged into the base); false: only
    # export/adapter, so a full fine-tuning run exports nothing
    export_merged: bool = True
    compile: bool = False
    # NaN/Inf loss or gradients: skip up to this many steps, then stop (workbench/guard/faults.py); 0 = stop
    max_bad_steps: int = 0
    # a supervised run whose loss has not improved for N steps warns once, and its end says so
    # (workbench/telemetry/stall.py); 0: never
    stall_steps: int = 100
    # Keep the best evaluated checkpoint in checkpoints/best/ (workbench/checkpoints/keep_best.py): a metric
    # such as loss/loss; mode auto = min for losses/perplexity, else max; export_best exports it.
    keep_best: str | None = None
    keep_best_mode: str = "auto"  # auto | min | max
    export_best: bool = False
    # PNG curves in <run_dir>/plots/, embedded in report.md and sent to the trackers (workbench/telemetry/plots.py)
    plots: bool = True


@dataclass
class LmEvalConfig:
    """eval.tasks=[lm_eval:<task or task.yaml>] (workbench/evals/lm_eval_task.py)."""

    limit: int | None = None  # at most this many documents per task (None: all)
    batch_size: int = 8  # lm-eval-harness's batch size
    num_fewshot: int | None = None  # None: the task's own default


@dataclass
class EvalConfig:
    every_n_steps: int = 0  # 0 = only before and after training
    at_start: bool = True  # evaluate before the first step (not when resuming)
    at_end: bool = True  # evaluate after the last step
    # built-ins (loss, preference, reward, generate, arith_*) or `package.module:function`
    # (workbench/evals/hooks.py)
    tasks: list[str] = field(default_factory=lambda: ["arith_add2"])
    num_samples: int = 100  # at most this many held-out rows / questions per task
    batch_size: int = 50  # rows or questions per evaluation forward / generate call
    # tokens a greedy answer may take in the generating tasks (arith_*, needle, a hook's
    # ctx.generate); the reward task uses method.max_new_tokens where the method has one
    max_new_tokens: int = 8
    prompts: Any = None  # `generate`: a list of prompts, or a .txt (one per line) / .jsonl file
    generate_max_new_tokens: int = 64  # tokens each completion of the `generate` task may take
    # an evaluation hook that runs longer stops the run naming it; also the watchdog's budget for
    # evaluations, checkpoints and the export
    timeout_s: float = 1800.0
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)


@dataclass
class HardwareConfig:
    name: str = "cpu"  # the profile (conf/hardware/<name>.yaml), as plans and the calibration cache name it
    device: str = "cpu"  # cpu | cuda
    procs: int = 1  # processes per node (torchrun's nproc_per_node)
    nodes: int = 1  # machines; devices = procs x nodes (> 1: set rdzv_endpoint, or use launcher=slurm / ray)
    threads: int = 0  # torch intra-op threads per process; 0 = leave as is
    # Catalog facts (per device) used by the planner; 0 / empty where unknown.
    accelerator: str = "cpu"  # the device model (e.g. H100 SXM 80GB); bandwidth and cloud GPU types are looked up by it
    memory_gb: float = 0.0
    bf16_tflops: float = 0.0  # dense bf16 TFLOP/s per device (datasheet): time estimates and MFU; 0: unknown
    fp8_tflops: float = 0.0  # dense fp8 TFLOP/s per device; 0 with bf16_tflops set: no fp8 units (precision=fp8 refused)
    interconnect: str = ""  # how the devices are linked, as text for people (no code reads it)
    price_per_hour: list[float] = field(default_factory=list)  # [low, high] USD per device-hour
    price_date: str = ""  # when price_per_hour was quoted (YYYY-MM), printed with the plan's costs
    # Launch: torchrun elastic agent and rendezvous.
    max_restarts: int = 0  # torchrun restarts of the worker group after a failure (each resumes from the last checkpoint)
    rdzv_endpoint: str = ""  # host:port of the rendezvous (multi-node)
    rdzv_id: str = "workbench"  # torchrun's rendezvous id: the same on every node of a run, distinct between runs
    node_rank: int = -1  # -1: let the rendezvous assign it
    # this node's address the others connect to; "": the address that routes to rdzv_endpoint
    # (workbench/launch/network.py), whose interface gloo/NCCL are then pinned to
    node_addr: str = ""
    rdzv_timeout_s: float = 300.0  # how long a node waits at the rendezvous for the others
    min_nodes: int = 0  # fewest nodes a multi-node run continues on after losing one; 0: hardware.nodes
    timeout_minutes: int = 30  # collective timeout
    # the watchdog (workbench/guard/watchdog.py): seconds without progress before a run is called
    # stalled; 0: twenty times the median step time, at least 300 s (600 s until 3 steps are timed)
    stall_timeout_s: float = 0.0
    watchdog: bool = True  # false: no watchdog thread (e.g. stepping through a run in a debugger)
    env: dict[str, str] = field(default_factory=dict)  # NCCL and other presets for this profile


@dataclass
class PlanConfig:
    """The planner (workbench/plan/): printed by dry_run=true, checked before every run."""

    json: bool = False  # dry_run prints the plan as JSON instead of tables
    mfu: float = 0.4  # model-FLOPs utilisation assumed for time and cost
    tokens: float = 0.0  # tokens the run trains on; 0 = max_steps x global batch x seq_len
    select_fraction: float = 1.0  # share of positions with a loss (answer-only SFT needs fewer)
    teacher_scale: float = 1.0  # method=distill: teacher parameters / student parameters (its frozen copy's memory)
    compare: bool = False  # the "where it runs" table lists every profile (plan.hardware), not just this one
    hardware: list[str] = field(default_factory=list)  # profiles plan.compare lists; empty = all
    enforce: bool = True  # refuse a real run whose plan does not fit the configured hardware
    # after this many steps compare measured memory, step time and tokens/s with the plan
    # (workbench/plan/check.py); 0: never
    check_after_steps: int = 10
    calibrate: bool = False  # keep measured/predicted per hardware; later dry runs use it


# The GGUF types the export writes: those llama.cpp's own converter writes that gguf.quants can
# produce in Python (workbench/export/gguf.py); K-quants need llama.cpp's llama-quantize.
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")


@dataclass
class ExportConfig:
    """What the export writes besides the adapter and merged folders (workbench/export/write.py)."""

    gguf: list[str] = field(default_factory=list)  # f32 | f16 | bf16 | q8_0 (workbench/export/gguf.py)
    parity_prompts: int = 20  # held-out prompts the parity gate compares on (workbench/export/parity.py)
    allow_mismatch: bool = False  # a failed parity gate is reported, not fatal
    card: bool = True  # README.md model card in export/merged
    push_to_hub: str | None = None  # org/name: upload export/merged (+ GGUF files); token from $HF_TOKEN
    private: bool = True  # a repo push_to_hub creates is private


@dataclass
class DebugConfig:
    # fault injection: crash_rank exits like a killed process at this step, on the first attempt
    # only (restart tests); -1: off
    crash_at_step: int = -1
    nan_at_step: int = -1  # fault injection: this step's loss is NaN (workbench/guard/faults.py)
    crash_rank: int = 0  # the rank crash_at_step kills
    step_sleep_s: float = 0.0  # fault injection: every step takes this much longer (signal and node-loss tests)
    overfit_batches: int = 0  # N > 0: every step trains on the first N batches in turn (debug=overfit); 0: off
    # fault injection for the watchdog: hang_rank sleeps when it enters hang_phase (data, rollout,
    # reward function, forward, backward, optimizer, ...) at step hang_at_step (0-based)
    hang_phase: str | None = None
    hang_at_step: int = -1
    hang_rank: int = 0  # the rank that hangs (hang_phase, hang_at_step)
    # smoke runs (debug=fast sets 8): every sampled completion and episode turn at most this many
    # tokens, at most 2 turns an episode, no refill rounds (workbench/resolve/validate.py), so a method
    # that generates finishes in seconds on a random model, which never stops on its own
    max_new_tokens: int | None = None


# -- trackers (workbench/telemetry/trackers.py; a chosen tracker's node is not None) --------------------
@dataclass
class TensorBoardOptions:
    dir: str = "tensorboard"  # the event files' directory, relative to the run dir
    flush_secs: int = 30  # seconds between writes of pending events to disk


@dataclass
class WandbOptions:
    project: str = "workbench"  # the W&B project the run logs to
    entity: str | None = None  # W&B team or user; null: your default entity
    name: str | None = None  # default: the run dir's name
    mode: str = "online"  # online | offline | disabled
    tags: list[str] | None = None  # W&B run tags; null: none


@dataclass
class MlflowOptions:
    tracking_uri: str | None = None  # an MLflow server or database URI; null: a file store in <run_dir>/mlruns
    experiment: str = "workbench"  # MLflow experiment, created when missing
    run_name: str | None = None  # null: the run dir's name


@dataclass
class TrackioOptions:
    project: str = "workbench"  # trackio project (`trackio show --project <project>`)
    name: str | None = None  # null: the run dir's name


@dataclass
class TrackerConfig:
    tensorboard: TensorBoardOptions | None = None
    wandb: WandbOptions | None = None
    mlflow: MlflowOptions | None = None
    trackio: TrackioOptions | None = None


@dataclass
class Schema:
    """The whole run. `method` and `backend` are checked against their modules' own schemas."""

    method: Any = None
    backend: Any = None
    model: ModelConfig = field(default_factory=ModelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    # the run directory: checkpoints, export/, metrics.jsonl, report.md, manifest.json;
    # conf/train.yaml sets runs/<date>_<time>, and under -m each job gets its sweep subdir
    output_dir: str = "runs/default"
    # false | true (preflight and plan, no weights) | trace (also the step on fake tensors: workbench/plan/trace.py)
    dry_run: Any = False
    launcher: Any = None  # where the run executes (conf/launcher/; options checked by workbench/launch/)
    reward: Any = None  # GRPO reward functions (conf/reward/)
    env: Any = None  # GRPO environment for multi-turn episodes (conf/env/, workbench/envs/)
    kernels: str = "none"  # none | liger
    tracker: TrackerConfig = field(default_factory=TrackerConfig)  # conf/tracker/, workbench/telemetry/trackers.py


# Schema-backed groups: each YAML in conf/<group>/ starts with `defaults: [_schema, _self_]`, so
# Hydra composes it onto the dataclass. Every field can then be overridden on the command line
# (`model.loader=unsloth`) even when the YAML does not mention it, and a YAML with an unknown
# key fails at composition.
SCHEMA_GROUPS = {"model": ModelConfig, "peft": PeftConfig, "data": DataConfig, "optim": OptimConfig,
                 "eval": EvalConfig, "hardware": HardwareConfig, "precision": PrecisionConfig}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for group, node in SCHEMA_GROUPS.items():
        store.store(group=group, name="_schema", node=node)


register_schemas()


