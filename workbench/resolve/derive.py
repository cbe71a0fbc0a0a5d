"""The run, derived: every decision the validated config implies, made once.

    from workbench.resolve.resolved import resolve_run
    run = resolve_run(cfg)        # cfg from config.validate(); refuses a broken combination (rules.py)
    run = derive(cfg)         # the same facts without the rules (the planner sizes anything)
    run.precision.compute_dtype, run.load_dtype, run.export_dtype
    run.peft.adapter, run.peft.quantised, run.peft.quant_storage
    run.reference             # none | adapter | copy | precomputed
    run.layout.dp, run.layout.dp_rank, run.layout.tp, run.layout.pp
    run.batch.size            # sequences (or completions) per optimizer step, all ranks

Preflight, the planner, the runner, the backends, the methods and export read this object. None
of them derives these facts again, and none writes to the config: `config.validate` returns it
read-only. `tests/unit/test_resolved.py` holds the code to that (grep-level).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from omegaconf import DictConfig

from workbench.backends import registry as backends
from workbench.backends.spec import BackendFacts, BackendTerms
from workbench.compute import precision
from workbench.core.errors import UserError
from workbench.methods import registry
from workbench.methods.spec import MethodFacts
from workbench.peft.kind import Peft
from workbench.train.layout import Layout, layout

REFERENCES = ("none", "adapter", "copy", "precomputed")


@dataclass(frozen=True)
class GlobalBatch:
    micro: int  # rows per micro-batch on one rank
    accum: int  # micro-batches per optimizer step
    dp: int  # data-parallel ranks

    @property
    def per_rank(self) -> int:
        """Rows one data-parallel rank trains on per step (what every method draws per rank)."""
        return self.micro * self.accum

    @property
    def size(self) -> int:
        return self.micro * self.accum * self.dp

    def describe(self) -> str:
        return f"{self.micro} per micro-batch x {self.accum} accumulated x {self.dp} data-parallel = {self.size}"


@dataclass(frozen=True)
class Run:
    cfg: DictConfig  # validated and read-only
    device: str
    precision: precision.Policy
    peft: Peft
    reference: str
    layout: Layout
    batch: GlobalBatch
    facts: MethodFacts  # what the method needs (workbench/methods/spec.py)
    warnings: tuple[str, ...] = ()  # rules about this machine that only warn (planning, remote launch)

    def on(self, device: str) -> Run:
        """The same run with its weights on another device (a plain copy rebuilt on the CPU)."""
        return replace(self, device=device)

    @property
    def load_dtype(self) -> torch.dtype:
        """Base weights load in the policy's half dtype under adapters (they stay frozen);
        a full fine-tune loads fp32 and casts per parameter (precision.cast_params)."""
        return self.precision.load_dtype if self.peft.adapter else torch.float32

    @property
    def export_dtype(self) -> torch.dtype:
        """Merged weights are written in fp32 for fp32 runs, else in bf16."""
        return torch.float32 if self.precision.name == "fp32" else torch.bfloat16

    @property
    def backend_facts(self) -> BackendFacts:
        """What the backend is (workbench/backends/spec.py), as `facts` is what the method needs;
        modules below the registries (FLOP counting, resume) read it here."""
        return backends.spec(self.cfg.backend.name).facts

    @property
    def backend_terms(self) -> BackendTerms:
        """The backend's options in the planner's terms (BackendSpec.terms): its ZeRO stage,
        offload, parallel and checkpointing choices, for modules that must not read an option
        by name (resume's layout record)."""
        return backends.spec(self.cfg.backend.name).terms(self.cfg.backend)

    @property
    def pad_free(self) -> bool:
        """SFT micro-batches may be packed padding-free (data.pad_free), except under a backend
        whose RoPE takes positions 0..T-1 only (Megatron; packed rows restart them per example)."""
        return bool(self.cfg.data.get("pad_free", False)) and not self.backend_facts.fixed_positions

    @property
    def keeps_hf_base(self) -> bool:
        """Whether the HF model keeps its base weights once the backend holds the model.
        backend=megatron bridges them into its own GPTModel shards; with adapters, and nothing
        that reads the HF base between steps (no generation, a reference that is the
        adapter-free Megatron model or none), the HF model keeps only its trainable tensors, and
        evaluation and export rebuild the base from its source on rank 0 (on the CPU), as the
        sharding backends do. A full fine-tune keeps it: export reads the weights bridged back."""
        return not (self.backend_facts.bridges_hf_model and self.peft.adapter and not self.facts.generates
                    and self.reference in ("none", "adapter"))

    @property
    def model_device(self) -> str:
        """Where the runner loads the HF model: the run's device, or the host when the backend
        keeps none of its base (keeps_hf_base), so the whole model never has to fit on one device."""
        return self.device if self.keeps_hf_base else "cpu"

    @property
    def merge_source(self) -> torch.dtype:
        """The dtype merged weights come from: adapters merge in fp32 (peft), a full fine-tune's
        weights are its trainable dtype."""
        return torch.float32 if self.peft.adapter else self.precision.trainable_dtype

    @property
    def loss_chunk(self) -> int:
        """Positions per checkpointed piece of the head (workbench/models/head.py): model.loss_chunk
        when set; else AUTO_CHUNK where one micro-batch's logits at once would pass
        AUTO_CHUNK_BYTES (a 262,144-token vocabulary: Gemma 3's 16 x 256 positions take 12 GiB in
        the fp32 loss), else 0, all at once. The planner reads the same number (plan/make.py)."""
        if self.cfg.model.loss_chunk:
            return int(self.cfg.model.loss_chunk)
        return AUTO_CHUNK if logits_at_once(self.cfg) > AUTO_CHUNK_BYTES else 0

    def summary(self) -> dict:
        return {"device": self.device, "precision": self.precision.name, "compute_dtype": _name(self.precision.compute_dtype),
                "load_dtype": _name(self.load_dtype), "export_dtype": _name(self.export_dtype), "peft": self.peft.kind,
                "quant_storage": self.peft.quant_storage if self.peft.quantised else None, "reference": self.reference,
                "world": self.layout.world, "dp": self.layout.dp, "tp": self.layout.tp, "pp": self.layout.pp,
                "cp": self.layout.cp, "global_batch": self.batch.size,
                **({"precision_auto": precision.choose(self.device)[1]} if self.cfg.precision.name == "auto" else {})}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _method(cfg) -> DictConfig | None:
    return cfg.get("method")


def _backend(cfg) -> DictConfig | None:
    return cfg.get("backend")


def sharded(cfg) -> bool:
    """Whether the backend shards parameters (FSDP2, ZeRO-3): its facts say from which stage
    (backend.stage, or the backend's default stage where its options have none)."""
    b = _backend(cfg)
    spec = backends.spec(b.name if b is not None else "single")
    return spec.facts.shards(spec.terms(b).stage)  # the planner reads the same rule


def reference(cfg) -> str:
    """The reference model a method's loss needs (workbench/methods/spec.py): DPO and KTO by
    method.reference (auto: the adapter-free base under peft, a frozen copy without), GRPO only
    for its KL term (beta > 0), reference-free methods none."""
    m = _method(cfg)
    ref = registry.spec(m.name if m is not None else "sft").reference_choice(m)
    if ref == "auto":
        return "adapter" if cfg.peft.kind != "none" else "copy"
    return ref


def quant_storage(cfg) -> str:
    """QLoRA under sharding: packed 4-bit weights are stored in a float dtype so FSDP/ZeRO can
    flatten and shard them with the other parameters (uint8 storage cannot be); the policy's
    frozen dtype unless a float one was chosen."""
    storage = cfg.peft.quant_storage
    if cfg.peft.kind == "qlora" and sharded(cfg) and storage not in ("float32", "bfloat16", "float16"):
        return _name(precision.spec(precision_name(cfg)).frozen_dtype)
    return storage


# One micro-batch's logits at once above this are computed in AUTO_CHUNK-position pieces, each
# recomputed in the backward (Run.loss_chunk). SmolLM2's default run (16 x 256 positions, 49,152
# tokens: 2.4 GB) stays whole, as measured for its golden curves and throughput.
AUTO_CHUNK_BYTES = 4 * 1024**3
AUTO_CHUNK = 512


def logits_at_once(cfg) -> float:
    """Bytes of one micro-batch's logits in the loss: positions x vocabulary x 12 (the fp32
    log-softmax output and the gradients in and out of it, workbench/plan/memory.py)."""
    return float(cfg.train.micro_batch_size) * cfg.data.seq_len * cfg.model.arch.vocab * 12


def precision_name(cfg) -> str:
    """The precision the run trains in: the configured one, or for `precision=auto` what the
    run's device does fastest (precision.choose)."""
    name = cfg.precision.name
    return precision.choose(cfg.hardware.device)[0] if name == "auto" else name


def derive(cfg: DictConfig, rank: int | None = None, world: int | None = None, here: bool = False) -> Run:
    """The facts alone, no rules: the planner sizes whatever it is asked about. `here`: the run
    trains in this process (fp8 picks its library)."""
    lay = layout(cfg, rank, world)
    name = precision_name(cfg)
    pol = precision.policy(name) if here else precision.spec(name)
    return Run(cfg=cfg, device=cfg.hardware.device, precision=pol, peft=Peft(cfg.peft.kind, quant_storage(cfg)),
               reference=reference(cfg), layout=lay, batch=GlobalBatch(cfg.train.micro_batch_size, accum(cfg, lay), lay.dp),
               facts=registry.spec(cfg.method.name).facts)


def accum(cfg, lay: Layout) -> int:
    """Micro-batches per rank per step: train.grad_accum, or what the method's own step
    arithmetic makes of it (MethodSpec.batch: GRPO's method.prompts_per_step is that many groups
    at any layout). Where the method's options make no step at this layout, its rule refuses the
    run (grpo-whole-groups) and the planner sizes it with train.grad_accum."""
    m = _method(cfg)
    batch = registry.spec(m.name if m is not None else "sft").batch
    if batch is None:
        return cfg.train.grad_accum
    try:
        return batch(m, cfg.train.micro_batch_size, cfg.train.grad_accum, lay.dp).grad_accum
    except UserError:
        return cfg.train.grad_accum


def needs_bitsandbytes(cfg) -> bool:
    """QLoRA, or a loader that may quantise (unsloth); others need not import bitsandbytes."""
    return cfg.peft.kind == "qlora" or cfg.model.loader != "hf"
