"""LoRA, DoRA and QLoRA as an axis of their own: any method trains with or without adapters.

- `lora` / `dora`: PEFT adapters on the chosen Linear layers; base weights frozen.
- `qlora`: first the frozen Linear layers of the decoder blocks become bitsandbytes NF4
  `Linear4bit` (double-quantised constants), then LoRA goes on top. The lm_head and the
  embeddings stay in full precision.

`check_targets()` runs on the meta-device model during preflight, so a target module that the
model does not have is reported before any weights load.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from workbench.core.errors import UserError, missing_package
from workbench.core.imports import quiet_bitsandbytes

# peft imports bitsandbytes whenever it is installed, so before anything here imports peft:
# bitsandbytes' notice about an optional CPU kernel is not the user's to act on.
quiet_bitsandbytes()

# What "all-linear" means: every Linear inside the decoder blocks (never lm_head).
BLOCK_PREFIX = "layers."


def linear_names(model: nn.Module) -> list[str]:
    """Short names (e.g. q_proj) of the Linear layers inside the decoder blocks."""
    names = set()
    for full, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and BLOCK_PREFIX in full:
            names.add(full.rsplit(".", 1)[-1])
    return sorted(names)


def target_names(model: nn.Module, target_modules) -> list[str]:
    available = linear_names(model)
    if target_modules in ("all-linear", None):
        return available
    wanted = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    missing = [t for t in wanted if t not in available]
    if missing:
        raise UserError(f"peft.target_modules: {missing} not in the model; its linear layers are {available}")
    return wanted


def check_targets(meta_model: nn.Module, peft_cfg) -> None:
    if peft_cfg.kind != "none":
        target_names(meta_model, peft_cfg.target_modules)


def quantize_nf4(model: nn.Module, peft_cfg, compute_dtype: torch.dtype, quant_storage: str) -> nn.Module:
    """Replace the decoder blocks' Linear layers by NF4 Linear4bit (weights quantised in place)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise missing_package("bitsandbytes") from None
    storage = getattr(torch, quant_storage)
    device = next(model.parameters()).device
    for full, mod in list(model.named_modules()):
        if not (isinstance(mod, nn.Linear) and BLOCK_PREFIX in full):
            continue
        parent_name, child = full.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        q = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=mod.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=peft_cfg.double_quant,
                              quant_type=peft_cfg.quant_type, quant_storage=storage)
        q.weight = bnb.nn.Params4bit(mod.weight.data.float().contiguous(), requires_grad=False,
                                     quant_type=peft_cfg.quant_type,
                                     compress_statistics=peft_cfg.double_quant, quant_storage=storage)
        if mod.bias is not None:
            q.bias = nn.Parameter(mod.bias.data.clone(), requires_grad=False)
        # On a CPU with AVX512-BF16, bitsandbytes would repack the weight in place at the first
        # no-grad eval forward and compute it in bf16 whatever compute_dtype says: evaluation,
        # rollouts and the export's parity gate would then see other numbers than training did
        # (3e-3 on the tiny model's logits), and the export would dequantise a repacked weight.
        q.support_avx512bf16_for_cpu = False
        setattr(parent, child, q.to(device))  # .to() performs the quantisation
    return model


def apply(model: nn.Module, run) -> nn.Module:
    """Wrap `model` as the resolved run says (workbench/resolve/resolved.py); returns the model to train.
    NF4 layers compute in the policy's compute dtype and store in the resolved storage dtype."""
    if not run.peft.adapter:
        return model
    from peft import LoraConfig, get_peft_model

    peft_cfg = run.cfg.peft
    targets = target_names(model, peft_cfg.target_modules)
    if run.peft.quantised:
        model = quantize_nf4(model, peft_cfg, run.precision.compute_dtype, run.peft.quant_storage)
    config = LoraConfig(
        r=peft_cfg.r, lora_alpha=peft_cfg.alpha, lora_dropout=peft_cfg.dropout,
        target_modules=targets, use_dora=run.peft.dora, task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, config)
    # Adapters train in fp32 whatever the base dtype (their updates are tiny relative to W).
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


@contextlib.contextmanager
def inputs_in_autocast(model: nn.Module, autocast_dtype: torch.dtype | None):
    """Inside bf16/fp16 autocast, let plain LoRA layers pass their input to the adapter as it is.

    peft casts each adapted layer's input to the adapter's dtype (fp32 here) before the adapter's
    matmul, and autocast casts it straight back to bf16 for that matmul: an exact round trip
    (bf16 -> fp32 -> bf16) that costs two copies per adapted layer in the forward and two in the
    backward, and on the first step of the default run ~0.4 s of fresh memory. Skipping it
    gives bit-identical losses and gradients (tests/unit/test_lora_autocast.py). Only vanilla
    LoRA on nn.Linear without dropout (a dropout mask would be drawn on the fp32 copy; DoRA and
    NF4 layers use the input beyond the matmul). Callers wrap forward *and* backward, so a
    checkpointed block recomputes the way it first ran."""
    peft_lora = sys.modules.get("peft.tuners.lora.layer")  # not imported: no adapters to look for
    layers = [] if autocast_dtype is None or peft_lora is None else [
        m for m in model.modules()
        if type(m) is peft_lora.Linear and not m.lora_variant and m.cast_input_dtype_enabled
        and all(isinstance(d, nn.Identity) for d in m.lora_dropout.values())]
    for m in layers:
        m.cast_input_dtype_enabled = False
    try:
        yield
    finally:
        for m in layers:
            m.cast_input_dtype_enabled = True


def base_model(model: nn.Module) -> nn.Module:
    """The underlying *ForCausalLM module (PEFT wrappers removed, adapters still in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model

