"""Final export: what a user loads with `from_pretrained` or serves with vLLM.

    python -m workbench.export runs/<run>              # export its newest valid checkpoint again
    python -m workbench.export runs/<run> step=200 export.gguf=[f16]   # a given step, more formats

    <output_dir>/export/adapter/   PEFT adapter (safetensors) + tokenizer + generation_config
    <output_dir>/export/merged/    full model with adapters merged (safetensors) + tokenizer +
                                   chat template + generation_config whose eos_token_id is the
                                   end-of-turn token the model was trained to emit

Adapters are merged into a freshly loaded full-precision base, never into NF4 weights
(merging into 4-bit degrades quality, peft#2321). After writing, the merged model is loaded
back from disk and its logits compared with the trained model's on a probe batch; the
difference is recorded in the report.

A reward model (method=rm) is exported as a transformers *ForSequenceClassification instead:
`export/merged/` holds the decoder (adapters merged) with the trained scalar head as `score`,
`pad_token_id` in its config, and the tokenizer with its chat template, so
`AutoModelForSequenceClassification.from_pretrained(<run>/export/merged)` scores a sequence as
the trained model did; its parity gate compares those scores on held-out preference pairs.
No adapter directory is written for it: an adapter without the head is not a reward model.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from workbench.models.load import cast_weights, gguf_metadata, load_model
from workbench.peft.lora import base_model


def _generation_config(tokenizer, contract):
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=contract.end_of_turn_id, pad_token_id=tokenizer.pad_token_id,
                            bos_token_id=tokenizer.bos_token_id, do_sample=False)


def _save_tokenizer(tokenizer, contract, path: Path) -> None:
    tokenizer.save_pretrained(path)
    _generation_config(tokenizer, contract).save_pretrained(path)


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


def export(trained, tokenizer, contract, run, out_dir: Path, results: dict | None = None) -> dict:
    """`run`: the resolved run (workbench/resolved.py) the model was trained under."""
    from workbench.imports import hidden

    with hidden("deepspeed"):  # save_pretrained would import it just to probe (workbench/imports.py)
        return _export(trained, tokenizer, contract, run, out_dir, results or {})


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


def _parity_prompts(cfg) -> list:
    """Held-out prompts for the parity gate: the run's eval prompts (the shipped held-out
    arithmetic questions by default); never training rows."""
    from workbench.evals.hooks import eval_rows

    return [r["prompt"] for r in eval_rows("arith_add2", cfg.export.parity_prompts)]


def _export(trained, tokenizer, contract, run, out_dir: Path, results: dict) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    from workbench import catalog
    from workbench.parity import compare, rounding

    cfg = run.cfg
    if catalog.facts(cfg.method.name).scalar_head:
        return _export_reward_model(trained, tokenizer, run, Path(out_dir), results)
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
    source = _dtype_name(run.merge_source)
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=dtype)
    declared = GenerationConfig.from_pretrained(merged_dir).eos_token_id
    gate = compare(_fp32_copy(trained), _fp32_copy(reloaded), tokenizer, convs, eot,
                   rounding(source, _dtype_name(dtype)), declared_eos=declared)
    result["parity"]["merged"] = gate
    # the figures earlier reports carried, kept for continuity
    result["merged_vs_trained_max_abs_diff"] = gate["logit_max_abs_diff"]
    result["merged_vs_trained_argmax_agree"] = gate["argmax_agreement"]

    for kind in cfg.export.gguf:
        result["parity"][f"gguf-{kind}"] = _gguf(merged_dir, out_dir, kind, reloaded, tokenizer, contract, convs, cfg,
                                                 _dtype_name(dtype))
        result.setdefault("gguf", []).append(str(out_dir / "gguf" / f"model-{kind}.gguf"))
    if cfg.export.card:
        (merged_dir / "README.md").write_text(model_card(run, results, result))
    result["failed"] = [k for k, r in result["parity"].items() if not r["passed"]]
    if cfg.export.push_to_hub and not result["failed"]:  # a failed gate is never published
        from workbench import hub

        result["hub"] = hub.push(merged_dir, cfg.export.push_to_hub, [Path(p) for p in result.get("gguf", [])],
                                 private=cfg.export.private)
    trained.train()
    return result


# The reward model's gate: max |score difference| allowed, relative to max(1, largest |score|),
# by what the export rounds the weights to (parity.rounding). exact: the same fp32 weights, the
# sums reordered (SDPA with and without the padding mask, W + BA merged in fp32): a few ulps of
# the hidden state; 1e-4 leaves ~800 ulps. bf16: measured on SmolLM2-135M (LoRA RM, 2 steps,
# bf16-mixed, 20 held-out pairs) 1.3e-2; 5e-2 allows 4x that. f16 keeps 3 more mantissa bits
# (8x finer): 1e-2. A head with its sign flipped, or a dropped one, moves the scores by their own
# size.
SCORE_TOLERANCES = {"exact": 1e-4, "f16": 1e-2, "bf16": 5e-2}


def _export_reward_model(trained, tokenizer, run, out_dir: Path, results: dict) -> dict:
    """export/merged/ as a one-label sequence classifier, gated on held-out pair scores."""
    from transformers import AutoModelForSequenceClassification

    from workbench.models import value_head
    from workbench.parity import rounding

    cfg, dtype = run.cfg, run.export_dtype
    result: dict = {"parity": {}, "failed": []}
    if not cfg.train.export_merged:
        return result
    decoder = merged_model(trained, run, torch.float32)  # the adapters merged; its own head is not used
    head = base_model(trained).lm_head.weight
    seq = value_head.to_sequence_classifier(decoder, head.float(), tokenizer.pad_token_id, dtype)
    del decoder
    merged_dir = out_dir / "merged"
    seq.save_pretrained(merged_dir, safe_serialization=True)
    tokenizer.save_pretrained(merged_dir)
    result["merged"] = str(merged_dir)
    del seq

    pairs = _parity_pairs(tokenizer, cfg)
    reloaded = AutoModelForSequenceClassification.from_pretrained(merged_dir, dtype=dtype)
    gate = compare_scores(_fp32_copy(trained), _fp32_copy(reloaded), pairs, tokenizer.pad_token_id,
                          rounding(_dtype_name(run.merge_source), _dtype_name(dtype)))
    result["parity"]["merged"] = gate
    if cfg.export.card:
        (merged_dir / "README.md").write_text(model_card(run, results, result))
    result["failed"] = [k for k, r in result["parity"].items() if not r["passed"]]
    if cfg.export.push_to_hub and not result["failed"]:
        from workbench import hub

        result["hub"] = hub.push(merged_dir, cfg.export.push_to_hub, [], private=cfg.export.private)
    trained.train()
    return result


def _parity_pairs(tokenizer, cfg) -> list:
    """Held-out preference pairs (the shipped arithmetic ones, never trained on) for the RM gate."""
    from workbench.data.formats import prompt_ids, setup_tokenizer
    from workbench.data.preference import Pair, preference_row, tokenise_completion
    from workbench.evals.hooks import eval_rows

    contract = setup_tokenizer(tokenizer)
    pairs = []
    for i, row in enumerate(eval_rows("arith_pref", cfg.export.parity_prompts)):
        p, c, r = preference_row(row, f"arith_pref_eval.jsonl:{i + 1}")
        ids = prompt_ids(tokenizer, p)
        pairs.append(Pair(tokenise_completion(tokenizer, contract, p, c, ids),
                          tokenise_completion(tokenizer, contract, p, r, ids), len(ids)))
    return pairs


@torch.no_grad()
def compare_scores(trained, classifier, pairs: list, pad_id: int, kind: str) -> dict:
    """Scores of the trained model (scalar head, as in training) against the exported classifier
    read back by transformers, on the same right-padded batch."""
    from workbench.methods.rm import collate, pair_rewards

    ours = pair_rewards(trained, pairs, pad_id, share_prompt=False)  # the same rows the classifier reads
    micro = collate(pairs, pad_id)
    classifier.eval()
    theirs = classifier(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits[:, 0]
    theirs = theirs.float().view(2, -1)
    diff = float((ours - theirs).abs().max())
    scale = max(1.0, float(ours.abs().max()))
    agree = int(((ours[0] > ours[1]) == (theirs[0] > theirs[1])).sum())
    tol = SCORE_TOLERANCES.get(kind, SCORE_TOLERANCES["bf16"])
    return {"rounding": kind, "prompts": len(pairs), "score_max_abs_diff": diff, "score_scale": scale,
            "score_tolerance": tol, "decisions_agree": agree, "passed": bool(diff <= tol * scale)}


def _fp32_copy(model):
    """A copy computing in fp32: the parity gate compares weights, not bf16 arithmetic. Values
    are unchanged (widening is exact); 4-bit layers keep their storage and dequantise to fp32."""
    out = copy.deepcopy(model)
    cast_weights(out, torch.float32)
    for m in out.modules():
        if hasattr(m, "compute_dtype"):  # bitsandbytes Linear4bit
            m.compute_dtype = torch.float32
    return out


def _gguf(merged_dir, out_dir, kind, merged, tokenizer, contract, convs, cfg, merged_dtype) -> dict:
    """Write one GGUF file and gate it against the merged model it was converted from."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from workbench.parity import compare, rounding
    from workbench.to_gguf import write

    path = write(merged_dir, out_dir / "gguf" / f"model-{kind}.gguf", kind, eos_id=contract.end_of_turn_id,
                 pre=gguf_metadata(cfg.model).get("tokenizer.ggml.pre"))
    field = GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"]
    declared = int(field.contents())
    back = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    gate = compare(_fp32_copy(merged), back, tokenizer, convs, contract.end_of_turn_id, rounding(merged_dtype, kind),
                   declared_eos=declared)
    gate["path"], gate["bytes"] = str(path), path.stat().st_size
    return gate


def model_card(run, results: dict, export: dict) -> str:
    """README.md for the merged folder: what it is, how it was made, how it scored."""
    import json as _json

    cfg = run.cfg
    base = cfg.model.hub_id or cfg.model.path or cfg.model.name
    evals = {k: v for k, v in (results.get("eval_end") or {}).items() if isinstance(v, float)}
    before = results.get("eval_start") or {}
    what = ("A reward model: a one-label sequence classifier (score at the last non-padding token), adapters "
            "merged." if export.get("parity", {}).get("merged", {}).get("score_max_abs_diff") is not None else
            "The adapters are merged; generation_config.json stops on the end-of-turn token the model was "
            "trained to emit.")
    lines = ["---", f"base_model: {base}", "library_name: transformers", "tags: [workbench, "
             f"{cfg.method.name}{', ' + run.peft.kind if run.peft.adapter else ''}]", "---", "",
             f"# {Path(cfg.output_dir).name}", "",
             f"Fine-tuned from `{base}` with `method={cfg.method.name}` and `peft={run.peft.kind}` "
             f"(`precision={run.precision.name}`, {cfg.train.max_steps} steps of {cfg.train.micro_batch_size} x "
             f"{cfg.train.grad_accum} per rank). {what}", "",
             "## Evaluation", ""]
    if evals:
        lines += ["| metric | before | after |", "|---|---|---|"]
        lines += [f"| {k} | {before.get(k, float('nan')):.4f} | {v:.4f} |" for k, v in sorted(evals.items())]
    else:
        lines.append("No evaluation was run.")
    lines += ["", "## Export checks", "", "| file | rounding | KL (mean) | greedy equal | stop token | passed |",
              "|---|---|---|---|---|---|"]
    for name, r in export.get("parity", {}).items():
        if "kl_mean" not in r:  # a reward model's gate compares scores, not next-token distributions
            lines.append(f"| {name} | {r['rounding']} | max score diff {r['score_max_abs_diff']:.2e} | "
                         f"{r['decisions_agree']}/{r['prompts']} pairs ordered alike | - | {r['passed']} |")
            continue
        lines.append(f"| {name} | {r['rounding']} | {r['kl_mean']:.2e} | {r['greedy_equal']}/{r['prompts']} | "
                     f"{r['declared_eos']} | {r['passed']} |")
    lines += ["", "## How it was made", "", "The run directory holds `config.yaml` (the composed config, secrets "
              "removed) and `manifest.json` (package versions, git commit, data fingerprints). Overrides:", "",
              "```", "python -m workbench " + " ".join(_overrides()), "```", "",
              f"License: as the base model's ({_license(cfg)}).", ""]
    return "\n".join(lines) + ("\n<!-- " + _json.dumps({"workbench": True}) + " -->\n")


def _overrides() -> list[str]:
    """The command line's overrides, with secret-looking values removed."""
    from workbench.manifest import REDACTED, SECRET_KEY

    try:
        from hydra.core.hydra_config import HydraConfig

        items = list(HydraConfig.get().overrides.task)
    except Exception:  # noqa: BLE001 - not under a Hydra run (tests, python API)
        return []
    out = []
    for o in items:
        key = o.split("=", 1)[0].lstrip("+~").split(".")[-1]
        out.append(f"{o.split('=', 1)[0]}={REDACTED}" if SECRET_KEY.search(key) or "token" in o.lower() else o)
    return out


def _license(cfg) -> str:
    return gguf_metadata(cfg.model).get("general.license") or "see the base model's card"


def main(argv: list[str]) -> int:
    """Export a saved checkpoint without training: the run's own config (its config.yaml) with
    the checkpoint as the resume point and max_steps at its step, through the normal entry
    point, so sharded FSDP2 / DeepSpeed / Megatron checkpoints are gathered by the backend that
    wrote them (torchrun is started with the run's hardware.procs). Output:
    <run_dir>/exports/step-N/export/."""
    import subprocess
    import sys

    from workbench import checkpoint
    from workbench.errors import UserError

    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 2
    run_dir, extra, step = Path(argv[0]).resolve(), [], None
    for a in argv[1:]:
        if a.startswith("step="):
            step = int(a.split("=", 1)[1])
        else:
            extra.append(a)
    try:
        if not (run_dir / "config.yaml").exists():
            raise UserError(f"{run_dir}: no config.yaml (not a workbench run directory)")
        path = (checkpoint.ckpt_root(run_dir) / f"step-{step:08d}") if step is not None else checkpoint.latest(run_dir)
        if path is None or not path.is_dir():
            raise UserError(f"{run_dir}: no checkpoint {f'step-{step:08d}' if step is not None else 'to export'}")
        why = checkpoint.verify(path)
        if why is not None:
            raise UserError(f"{path}: not a usable checkpoint ({why})")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = int(path.name.split("-")[1])
    cmd = [sys.executable, "-m", "workbench", "--config-path", str(run_dir), "--config-name", "config",
           f"train.resume={path}", f"train.max_steps={n}", "train.export=true", "eval.at_start=false",
           "eval.at_end=false", "eval.every_n_steps=0", f"output_dir={run_dir / 'exports' / path.name}", *extra]
    return subprocess.call(cmd)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
