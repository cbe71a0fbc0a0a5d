"""A reward model's export (method=rm): a transformers *ForSequenceClassification.

`export/merged/` holds the decoder (adapters merged) with the trained scalar head as `score`,
`pad_token_id` in its config, and the tokenizer with its chat template, so
`AutoModelForSequenceClassification.from_pretrained(<run>/export/merged)` scores a sequence as
the trained model did; its parity gate compares those scores on held-out preference pairs. No
adapter directory is written for it: an adapter without the head is not a reward model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workbench.data.chat import prompt_ids, setup_tokenizer
from workbench.data.preference import Pair, preference_row, tokenise_completion
from workbench.evals.hooks import eval_rows
from workbench.export import hub
from workbench.export.card import model_card
from workbench.export.merge import dtype_name, fp32_copy, merged_model
from workbench.export.parity import rounding
from workbench.methods.rm import collate, pair_rewards
from workbench.models import value_head
from workbench.peft.lora import base_model

# The reward model's gate: max |score difference| allowed, relative to max(1, largest |score|),
# by what the export rounds the weights to (parity.rounding). exact: the same fp32 weights, the
# sums reordered (SDPA with and without the padding mask, W + BA merged in fp32): a few ulps of
# the hidden state; 1e-4 leaves ~800 ulps. bf16: measured on SmolLM2-135M (LoRA RM, 2 steps,
# bf16-mixed, 20 held-out pairs) 1.3e-2; 5e-2 allows 4x that. f16 keeps 3 more mantissa bits
# (8x finer): 1e-2. A head with its sign flipped, or a dropped one, moves the scores by their own
# size.
SCORE_TOLERANCES = {"exact": 1e-4, "f16": 1e-2, "bf16": 5e-2}


def export_reward_model(trained, tokenizer, run, out_dir: Path, results: dict) -> dict:
    """export/merged/ as a one-label sequence classifier, gated on held-out pair scores."""
    from transformers import AutoModelForSequenceClassification


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
    gate = compare_scores(fp32_copy(trained), fp32_copy(reloaded), pairs, tokenizer.pad_token_id,
                          rounding(dtype_name(run.merge_source), dtype_name(dtype)))
    result["parity"]["merged"] = gate
    if cfg.export.card:
        (merged_dir / "README.md").write_text(model_card(run, results, result))
    result["failed"] = [k for k, r in result["parity"].items() if not r["passed"]]
    if cfg.export.push_to_hub and not result["failed"]:
        result["hub"] = hub.push(merged_dir, cfg.export.push_to_hub, [], private=cfg.export.private)
    trained.train()
    return result


def _parity_pairs(tokenizer, cfg) -> list:
    """Held-out preference pairs (the shipped arithmetic ones, never trained on) for the RM gate."""
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
