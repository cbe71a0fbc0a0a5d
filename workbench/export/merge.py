"""The trained model as a plain *ForCausalLM: adapters merged into a freshly loaded base.

Adapters are merged in fp32 into the base loaded at full precision, never into NF4 weights
(merging into 4-bit degrades quality, peft#2321): a QLoRA adapter is merged into the NF4
weights dequantised, what every training forward saw. `fp32_copy` is what the parity gate
compares: the same values computing in fp32.
"""

from __future__ import annotations

import copy

import torch

from workbench.models.load import cast_weights, load_model
from workbench.peft.lora import base_model


def merged_model(trained, run, dtype: torch.dtype):
    """A plain *ForCausalLM with the trained weights (adapters merged) in `dtype`."""
    if not run.peft.adapter:
        model = copy.deepcopy(base_model(trained))
        cast_weights(model, dtype)
        return model
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    # Reload the base at full precision, attach the adapters, merge in fp32. QLoRA adapters were
    # trained against the NF4 weights, so the base they are merged into is those weights
    # dequantised (what every training forward saw), not the original ones and never the 4-bit
    # storage itself (re-quantising after the merge would compound the error, peft#2321).
    fresh = load_model(run.cfg.model, dtype=torch.float32)
    if run.peft.quantised:
        _dequantised_base_into(trained, fresh)
    from peft import get_peft_model

    peft_model = get_peft_model(fresh, copy.deepcopy(trained.peft_config["default"]))
    set_peft_model_state_dict(peft_model, get_peft_model_state_dict(trained))
    merged = peft_model.merge_and_unload()
    cast_weights(merged, dtype)
    return merged


def _dequantised_base_into(trained, fresh) -> None:
    import bitsandbytes as bnb

    n = 0
    for name, mod in base_model(trained).named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            w = bnb.functional.dequantize_4bit(mod.weight.data, mod.weight.quant_state).float()
            target = fresh.get_submodule(name.removesuffix(".base_layer"))
            with torch.no_grad():
                target.weight.copy_(w.reshape(target.weight.shape))
            n += 1
    if n == 0:
        raise RuntimeError("peft=qlora export: no 4-bit layers found in the trained model")


def fp32_copy(model):
    """A copy computing in fp32: the parity gate compares weights, not bf16 arithmetic. Values
    are unchanged (widening is exact); 4-bit layers keep their storage and dequantise to fp32."""
    out = copy.deepcopy(model)
    cast_weights(out, torch.float32)
    for m in out.modules():
        if hasattr(m, "compute_dtype"):  # bitsandbytes Linear4bit
            m.compute_dtype = torch.float32
    return out


def dtype_name(dtype: torch.dtype) -> str:
    """The parity gate's name for a weight dtype (workbench/export/parity.py rounding)."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
