"""Final export: what a user loads with `from_pretrained` or serves with vLLM.

    <output_dir>/export/adapter/   PEFT adapter (safetensors) + tokenizer + generation_config
    <output_dir>/export/merged/    full model with adapters merged (safetensors) + tokenizer +
                                   chat template + generation_config whose eos_token_id is the
                                   end-of-turn token the model was trained to emit

Adapters are merged into a freshly loaded full-precision base, never into NF4 weights
(merging into 4-bit degrades quality, peft#2321). After writing, the merged model is loaded
back from disk and its logits compared with the trained model's on a probe batch; the
difference is recorded in the report.

A reward model (method=rm) is exported as a transformers *ForSequenceClassification instead
(workbench/export/reward_model.py). The merge is workbench/export/merge.py, the model card
workbench/export/card.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from workbench.core.imports import hidden
from workbench.evals.hooks import eval_rows
from workbench.export import hub, llama_cpp
from workbench.export.card import model_card
from workbench.export.gguf import write
from workbench.export.merge import dtype_name, fp32_copy, merged_model
from workbench.export.parity import compare, rounding
from workbench.export.reward_model import export_reward_model
from workbench.families import registry as families
from workbench.models.load import tokenizer_metadata


def _generation_config(tokenizer, contract):
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=contract.end_of_turn_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, do_sample=False)


def _save_tokenizer(tokenizer, contract, path: Path) -> None:
    tokenizer.save_pretrained(path)
    _generation_config(tokenizer, contract).save_pretrained(path)
    # A SentencePiece vocabulary's own file (Gemma): save_pretrained writes only tokenizer.json,
    # where piece scores and types are gone; GGUF (workbench/export/gguf.py) and tools that read
    # SentencePiece need them
    source = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "tokenizer.model"
    if source.is_file() and not (Path(path) / "tokenizer.model").exists():
        shutil.copyfile(source, Path(path) / "tokenizer.model")


def export(trained, tokenizer, contract, run, out_dir: Path, results: dict | None = None) -> dict:
    """`run`: the resolved run (workbench/resolve/resolved.py) the model was trained under."""
    try:
        with hidden("deepspeed"):  # save_pretrained would import it just to probe (workbench/core/imports.py)
            return _export(trained, tokenizer, contract, run, out_dir, results or {})
    finally:
        normal_permissions(Path(out_dir))


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else set and put back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_permissions(folder: Path) -> None:
    """Every file under `folder` readable as the user's umask says (0644 under the usual 022).
    transformers writes model.safetensors through a private temporary file, which leaves it 0600:
    an export others on the machine, a serving process under another user or a copy to a shared
    disk cannot read."""
    mode = 0o666 & ~_umask()
    for f in folder.rglob("*") if folder.is_dir() else ():
        if f.is_file() and not f.is_symlink() and (f.stat().st_mode & 0o777) != mode:
            os.chmod(f, mode)


def _parity_prompts(cfg) -> list:
    """Held-out prompts for the parity gate: the run's eval prompts (the shipped held-out
    arithmetic questions by default); never training rows."""
    return [r["prompt"] for r in eval_rows("arith_add2", cfg.export.parity_prompts)]


def _export(trained, tokenizer, contract, run, out_dir: Path, results: dict) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig


    cfg = run.cfg
    if run.facts.scalar_head:
        return export_reward_model(trained, tokenizer, run, Path(out_dir), results)
    out_dir = Path(out_dir)
    result: dict = {"parity": {}, "failed": []}
    dtype = run.export_dtype
    if run.peft.adapter:
        trained.save_pretrained(out_dir / "adapter", safe_serialization=True)
        _save_tokenizer(tokenizer, contract, out_dir / "adapter")
        result["adapter"] = str(out_dir / "adapter")
    if not cfg.train.export_merged:
        return result
    merged = merged_model(trained, run, dtype)
    merged.config.use_cache = True
    merged.generation_config = _generation_config(tokenizer, contract)
    merged_dir = out_dir / "merged"
    merged.save_pretrained(merged_dir, safe_serialization=True)
    _save_tokenizer(tokenizer, contract, merged_dir)
    result["merged"] = str(merged_dir)
    del merged

    # The parity gate: what is on disk, read back by transformers, against the trained model.
    convs = _parity_prompts(cfg)
    eot = contract.end_of_turn_id
    # merged weights are W + BA summed from fp32 adapters (peft), or the trainable weights as trained
    source = dtype_name(run.merge_source)
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=dtype)
    declared = GenerationConfig.from_pretrained(merged_dir).eos_token_id
    gate = compare(fp32_copy(trained), fp32_copy(reloaded), tokenizer, convs, eot,
                   rounding(source, dtype_name(dtype)), declared_eos=declared)
    result["parity"]["merged"] = gate
    # the figures earlier reports carried, kept for continuity
    result["merged_vs_trained_max_abs_diff"] = gate["logit_max_abs_diff"]
    result["merged_vs_trained_argmax_agree"] = gate["argmax_agreement"]

    for kind in cfg.export.gguf:
        result["parity"][f"gguf-{kind}"] = _gguf(merged_dir, out_dir, kind, reloaded, tokenizer, contract, convs, cfg,
                                                 dtype_name(dtype))
        result.setdefault("gguf", []).append(str(out_dir / "gguf" / f"model-{kind}.gguf"))
    if cfg.export.card:
        (merged_dir / "README.md").write_text(model_card(run, results, result))
    result["failed"] = [k for k, r in result["parity"].items() if not r["passed"]]
    if cfg.export.push_to_hub and not result["failed"]:  # a failed gate is never published

        result["hub"] = hub.push(merged_dir, cfg.export.push_to_hub, [Path(p) for p in result.get("gguf", [])],
                                 private=cfg.export.private)
    trained.train()
    return result


def _gguf(merged_dir, out_dir, kind, merged, tokenizer, contract, convs, cfg, merged_dtype) -> dict:
    """Write one GGUF file and gate it against the merged model it was converted from."""
    from gguf import GGUFReader

    path = write(merged_dir, out_dir / "gguf" / f"model-{kind}.gguf", kind, eos_id=contract.end_of_turn_id,
                 pre=tokenizer_metadata(cfg.model).get("tokenizer.ggml.pre"))
    field = GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"]
    declared = int(field.contents())
    back = _read_back(path, merged.config)
    reference = fp32_copy(merged)
    gate = compare(reference, back, tokenizer, convs, contract.end_of_turn_id, rounding(merged_dtype, kind),
                   declared_eos=declared)
    del back
    # the file in the engine it is for: its tokenizer, metadata and stop token as llama.cpp reads them
    gate["llama_cpp"] = llama_cpp.check(path, reference, tokenizer, convs, contract.end_of_turn_id,
                                        must_match=gate["greedy_must_match"])
    gate["passed"] = bool(gate["passed"] and gate["llama_cpp"]["passed"])
    gate["path"], gate["bytes"] = str(path), path.stat().st_size
    return gate


def _read_back(path: Path, config):
    """The GGUF file as transformers (5.17) reads it, with two gaps of its reader met by handing it
    the merged model's config: it takes no attention.key_length for some architectures (qwen3) and
    builds its default head size (Gemma: its attention scale, the released models' 256), and it
    reads a llama-architecture file whose name says "mistral" (the family spec's `read_back_as`) as
    model type mistral, for which gguf-py has no tensor map. The file carries both facts, and
    llama.cpp reads them (llama_cpp.check runs the file)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = families.get(config.model_type)
    read_as = spec.gguf.read_back_as if spec and spec.gguf else None
    if read_as:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = AutoConfig.for_model(read_as, **fields)
    else:
        back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        if _attention(back.config) == _attention(config):
            return back
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)


def _attention(config) -> tuple:
    """The head size and Gemma's attention scale, which GGUF files give as key_length alone."""
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head, getattr(config, "query_pre_attn_scalar", None)
