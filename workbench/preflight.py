"""Preflight: the checks every run makes before anything heavy, and alone with dry_run=true.

Everything here is cheap: the schema is already checked (config.validate); this module checks
that the combination makes sense on this hardware, that the model's weights can be found,
that the adapters' target modules exist (on a meta-device model, no weights), and that the
evaluation tasks exist. Data is checked when the method reads it, still before weights load.
"""

from __future__ import annotations

import importlib.util

import torch

from workbench.errors import UserError, missing_package
from workbench.evals.hooks import check_tasks
from workbench.models.load import build_meta, resolve
from workbench.peft.lora import check_targets
from workbench.precision import policy


def check(cfg) -> dict:
    """Raise UserError on the first problem; return facts found on the way."""
    device = cfg.hardware.device
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"hardware={cfg.hardware.name} wants CUDA but no GPU is visible; use hardware=cpu")
    policy(cfg.precision.name, device)
    if cfg.peft.kind == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
        raise missing_package("bitsandbytes")
    if cfg.model.loader == "unsloth":
        if device != "cuda":
            raise UserError("model.loader=unsloth needs a single CUDA GPU; on CPU use model.loader=hf")
        if cfg.hardware.procs * cfg.hardware.nodes > 1:
            raise UserError("model.loader=unsloth runs on one GPU only; use model.loader=hf with backend=fsdp2")
        if importlib.util.find_spec("unsloth") is None:
            raise missing_package("unsloth", "unsloth")
    check_tasks(cfg.eval.tasks)
    source = resolve(cfg.model)
    meta = build_meta(cfg.model)
    check_targets(meta, cfg.peft)
    n_params = sum(p.numel() for p in meta.parameters())
    return {"model_source": source.kind, "n_params": n_params}
