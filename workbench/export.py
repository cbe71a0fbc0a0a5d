"""Final export: what a user loads with `from_pretrained` or serves with vLLM.

    <output_dir>/export/adapter/   PEFT adapter (safetensors) + tokenizer + generation_config
    <output_dir>/export/merged/    full model with adapters merged (safetensors) + tokenizer +
                                   chat template + generation_config whose eos_token_id is the
                                   end-of-turn token the model was trained to emit

Adapters are merged into a freshly loaded full-precision base, never into NF4 weights
(merging into 4-bit degrades quality, peft#2321). After writing, the merged model is loaded
back from disk and its logits compared with the trained model's on a probe batch; the
difference is recorded in the report.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from workbench.models.load import cast_weights, load_model
from workbench.peft.lora import base_model


def _generation_config(tokenizer, contract):
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=contract.end_of_turn_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, do_sample=False)


def _save_tokenizer(tokenizer, contract, path: Path) -> None:
    tokenizer.save_pretrained(path)
    _generation_config(tokenizer, contract).save_pretrained(path)


def merged_model(trained, cfg, dtype: torch.dtype):
    """A plain *ForCausalLM with the trained weights (adapters merged) in `dtype`."""
    if cfg.peft.kind == "none":
        model = copy.deepcopy(base_model(trained))
        cast_weights(model, dtype)
        return model
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    # Reload the base at full precision (QLoRA trained against NF4; merging into the 4-bit
    # weights would compound the quantisation error), attach the adapters, merge.
    fresh = load_model(cfg.model, dtype=torch.float32)
    from peft import get_peft_model

    peft_model = get_peft_model(fresh, copy.deepcopy(trained.peft_config["default"]))
    set_peft_model_state_dict(peft_model, get_peft_model_state_dict(trained))
    merged = peft_model.merge_and_unload()
    cast_weights(merged, dtype)
    return merged


def rebuild_plain(cfg, pol, full_state: dict, only: set[str] | None = None):
    """A plain (unsharded) model for eval and export under sharding backends.

    `full_state` is the gathered state of the backend's root module (keys prefixed `inner.`).
    With peft, only the trainable (`only`) tensors are taken from it: the frozen base is
    reloaded from its source, where it is identical, so nothing big crosses ranks.
    """
    from workbench import precision
    from workbench.peft import lora

    with torch.random.fork_rng(devices=[]):  # rebuilding must not move this rank's RNG
        model = load_model(cfg.model, dtype=pol.load_dtype if cfg.peft.kind != "none" else torch.float32)
        model = lora.apply(model, cfg.peft, compute_dtype=pol.autocast_dtype or pol.trainable_dtype)
        precision.cast_params(model, pol)
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


@torch.no_grad()
def _logits(model, ids):
    model.eval()
    return model(input_ids=ids, use_cache=False).logits.float()


def export(trained, tokenizer, contract, cfg, out_dir: Path) -> dict:
    from workbench.imports import hidden

    with hidden("deepspeed"):  # save_pretrained would import it just to probe (workbench/imports.py)
        return _export(trained, tokenizer, contract, cfg, out_dir)


def _export(trained, tokenizer, contract, cfg, out_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    result: dict = {}
    dtype = torch.float32 if cfg.precision.name == "fp32" else torch.bfloat16
    if cfg.peft.kind != "none":
        trained.save_pretrained(out_dir / "adapter", safe_serialization=True)
        _save_tokenizer(tokenizer, contract, out_dir / "adapter")
        result["adapter"] = str(out_dir / "adapter")
    if not cfg.train.export_merged:
        return result
    merged = merged_model(trained, cfg, dtype)
    merged.config.use_cache = True
    merged.generation_config = _generation_config(tokenizer, contract)
    merged.save_pretrained(out_dir / "merged", safe_serialization=True)
    _save_tokenizer(tokenizer, contract, out_dir / "merged")
    result["merged"] = str(out_dir / "merged")

    # Round trip: what is on disk must reproduce what was in memory.
    probe = torch.tensor([tokenizer("What is 12 + 34? Answer with the number only.")["input_ids"]])
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir / "merged", dtype=dtype)
    disk_vs_memory = (_logits(reloaded, probe) - _logits(merged, probe)).abs().max().item()
    trained_logits = _logits(trained, probe)
    merged_vs_trained = (_logits(reloaded, probe) - trained_logits).abs().max().item()
    result["roundtrip_max_abs_diff"] = disk_vs_memory
    result["merged_vs_trained_max_abs_diff"] = merged_vs_trained
    result["merged_vs_trained_argmax_agree"] = float(
        (_logits(reloaded, probe).argmax(-1) == trained_logits.argmax(-1)).float().mean())
    trained.train()
    return result
