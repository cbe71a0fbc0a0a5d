"""The model as a run holds it: loaded at the resolved load dtype, kernels and checkpointing,
adapters (NF4 first for QLoRA), parameters cast to the precision policy, fp8 swaps.

    from workbench.models.build import build_model, rebuild_plain
    model = build_model(run)                              # the runner, before the backend wraps it
    plain = rebuild_plain(run, gathered_state, only)      # sharded backends, for eval and export
"""

from __future__ import annotations

import torch

from workbench.compute import kernels, precision
from workbench.models import value_head
from workbench.models.load import load_model
from workbench.peft import lora


def build_model(run, train: bool = True, base: torch.nn.Module | None = None) -> torch.nn.Module:
    """`train=False` leaves out what only training needs (kernels, checkpointing, fp8 swaps).
    `base`: the HF model, built already instead of loaded (the dry run's trace builds it from
    fake tensors, workbench/plan/trace.py); the rest is done to it as to a loaded one."""
    cfg = run.cfg
    model = base if base is not None else load_model(cfg.model, dtype=run.load_dtype, device=run.model_device)
    if train:
        kernels.apply(model, cfg.kernels, run.device)
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if run.peft.adapter:
                model.enable_input_require_grads()
    model = lora.apply(model, run)
    if run.facts.scalar_head:  # method=rm: a one-output head replaces lm_head

        value_head.attach(model)
    precision.cast_params(model, run.precision)
    if train and run.precision.fp8:
        precision.apply_fp8(model, run.precision)
    return model


def rebuild_plain(run, full_state: dict, only: set[str] | None = None) -> torch.nn.Module:
    """A plain (unsharded) model for eval and export under sharding backends.

    `full_state` is the gathered state of the backend's root module (keys prefixed `inner.`).
    With peft, only the trainable (`only`) tensors are taken from it: the frozen base is
    reloaded from its source, where it is identical, so nothing big crosses ranks.
    """
    with torch.random.fork_rng(devices=[]):  # rebuilding must not move this rank's RNG
        model = build_model(run.on("cpu"), train=False)
    state = {k.removeprefix("inner."): v for k, v in full_state.items() if only is None or k in only}
    params = {**dict(model.named_buffers()), **dict(model.named_parameters(remove_duplicate=False))}
    missing = [k for k in state if k not in params]
    if missing or not state:
        raise RuntimeError(f"gathered state does not fit the rebuilt model: {missing[:3] or 'empty state'}")
    with torch.no_grad():
        for k, v in state.items():
            target = params[k]
            if v.numel() != target.numel():
                raise RuntimeError(f"gathered {k} has {v.numel()} elements, the model {target.numel()}")
            target.copy_(v.reshape(target.shape).to(target.dtype))
    return model
