"""The parity gate: an exported model, loaded back by an independent reader, must behave like the
model it came from on held-out prompts.

    report = compare(reference, candidate, tokenizer, conversations, eot_id, rounding("bf16", "f16"))
    report["passed"]  # KL within the format's tolerance, greedy completions equal where the format
                      # is lossless (near-ties reported, not failed), the stop token honoured

Both models run in fp32 compute: the gate judges the exported weights, not the rounding noise
of bf16 arithmetic (which, under autocast, moved the same comparison's KL 5x). Measured per
prompt: the next-token distributions over every prompt position (mean and max KL
of candidate from reference, max |logit| difference, argmax agreement), then greedy completions
of both, which must stop on the end-of-turn token wherever the reference's do.

Tolerances per format, from what each format rounds (see TOLERANCES); write.py records every
report in results.json and the model card and fails the run on a mismatch unless
export.allow_mismatch=true.

Greedy equality is required only where rounding cannot decide it. Where the two greedy
completions part, the reference's margin there (its log-probability of its own next token minus
that of the candidate's; the top-1 minus top-2 gap when the candidate took the runner-up) is
compared with what this export's rounding moves the gap between two logits by: twice the largest
|logit| difference measured on the prompt positions (`rounding_reach`). A margin within that reach is
a near-tie (a model unsure between two answers, as a Gemma 3 f16 file was on 1 of 40 prompts at
KL 4e-6): reported with its margin, not failed. A larger margin is a disagreement rounding cannot
explain, and fails a format that must match. The KL tolerance still bounds the rounding itself,
so a broken file cannot widen the reach without failing on KL.
"""

from __future__ import annotations

import torch

from workbench.data.chat import prompt_ids
from workbench.rollout.generate import generate

# What an export step rounds the weights to decides its tolerance: (max mean KL in nats per
# position, greedy completions must be equal). Measured on SmolLM2-135M against its fp32
# weights, 20 held-out arithmetic prompts:
# - exact: nothing is rounded (same or a wider dtype; merging W + BA in fp32 only reorders a
#   sum, a few ulps of the logits, KL ~1e-10): KL <= 1e-6 and greedy equal.
# - f16 (11 mantissa bits): measured KL 3.7e-6, greedy 20/20: KL <= 1e-4 and greedy equal.
# - bf16 (8 mantissa bits): a LoRA merged into bf16 weights (the embedded default, 20 steps),
#   compared in fp32 compute: KL 6.1e-4 (max 6.5e-3 at one position), greedy 17/20; the bare
#   fp32 -> bf16 cast of SmolLM2's own weights: 1.3e-4, 18/20. KL <= 5e-3 (8x the merge), greedy
#   may differ. The same run with its adapter dropped: KL 0.17, greedy 0/20.
# - q8_0 (8-bit blocks of 32, one f16 scale each): measured KL 2.5e-3 (max 1.4e-2 at one
#   position), greedy 13/20: KL <= 2e-2, greedy may differ.
# A dropped or mis-scaled adapter, or a transposed tensor, moves the KL to 1e-1 and beyond.
TOLERANCES = {"exact": (1e-6, True), "f16": (1e-4, True), "bf16": (5e-3, False), "q8_0": (2e-2, False)}


def rounding(source_dtype: str, target: str) -> str:
    """Which TOLERANCES entry applies when weights held in `source_dtype` (fp32 | bf16 | fp16)
    are written as `target` (fp32 | bf16 | f16 | q8_0)."""
    target = {"f32": "fp32", "float32": "fp32", "fp16": "f16", "float16": "f16", "bfloat16": "bf16"}.get(target, target)
    source = {"float32": "fp32", "bfloat16": "bf16", "float16": "f16", "fp16": "f16"}.get(source_dtype, source_dtype)
    if target == "fp32" or target == source:
        return "exact"
    return target


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=ids, use_cache=False).logits.float()[0]


def compare(reference, candidate, tokenizer, conversations: list, eot_id: int, kind: str,
            declared_eos: int | None = None, max_new_tokens: int = 16, autocast=None) -> dict:
    """`kind` names the TOLERANCES entry (see rounding()); `declared_eos` is the stop token the export tells
    a serving engine (generation_config.json, GGUF metadata), which must be `eot_id`."""
    import contextlib

    kl_means, kl_max, max_abs, agree, n_pos = [], 0.0, 0.0, 0, 0
    for conv in conversations:
        ids = torch.tensor([prompt_ids(tokenizer, conv)])
        with autocast or contextlib.nullcontext():
            a, b = _logits(reference, ids), _logits(candidate, ids)
        lp_a, lp_b = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = (lp_a.exp() * (lp_a - lp_b)).sum(-1)  # KL(reference || candidate) per position
        kl_means.append(float(kl.mean()))
        kl_max = max(kl_max, float(kl.max()))
        max_abs = max(max_abs, float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n_pos += a.shape[0]
    ref_out = generate(reference, tokenizer, conversations, max_new_tokens, eot_id, autocast=autocast)
    cand_out = generate(candidate, tokenizer, conversations, max_new_tokens, eot_id, autocast=autocast)
    reach = 2 * max_abs  # the most this export moved the gap between two logits on the prompt positions
    partings = []
    for i, (conv, r, c) in enumerate(zip(conversations, ref_out, cand_out)):
        if r != c:
            at = next((k for k, (x, y) in enumerate(zip(r, c)) if x != y), min(len(r), len(c)))
            # generate() strips the end-of-turn token: the shorter completion chose it there
            ref_tok, cand_tok = (r[at] if at < len(r) else eot_id), (c[at] if at < len(c) else eot_id)
            ids = torch.tensor([prompt_ids(tokenizer, conv) + list(r[:at])])
            with autocast or contextlib.nullcontext():
                last = _logits(reference, ids)[-1]
            partings.append({"prompt": i, "position": at, **margins(last, ref_tok, cand_tok)})
    judged = judge_greedy(partings, reach)
    near = {d["prompt"] for d in judged["near_ties"]}
    # generate() strips the end-of-turn token: a completion shorter than the budget stopped on it
    stops = [len(r) < max_new_tokens for r in ref_out]
    cand_stops = [len(c) < max_new_tokens for c in cand_out]
    kl_tol, greedy_must_match = TOLERANCES[kind]
    equal = sum(r == c for r, c in zip(ref_out, cand_out))
    # a stop the reference chose by a near-tie is rounding's to move, like any other near-tie
    stop_ok = all(c for i, (s, c) in enumerate(zip(stops, cand_stops)) if s and i not in near) and (
        declared_eos is None or declared_eos == eot_id)
    report = {"rounding": kind, "prompts": len(conversations), "kl_mean": sum(kl_means) / len(kl_means),
              "kl_max": kl_max, "logit_max_abs_diff": max_abs, "argmax_agreement": agree / n_pos,
              "greedy_equal": equal, "greedy_near_ties": len(judged["near_ties"]),
              "greedy_disagreements": len(judged["disagreements"]), "rounding_reach": reach,
              "near_ties": judged["near_ties"], "disagreements": judged["disagreements"],
              "declared_eos": declared_eos, "stop_honoured": stop_ok,
              "kl_tolerance": kl_tol, "greedy_must_match": greedy_must_match}
    report["passed"] = bool(report["kl_mean"] <= kl_tol and report["stop_honoured"]
                            and (judged["passed"] or not greedy_must_match))
    return report


def margins(logits: torch.Tensor, ref_token: int, cand_token: int) -> dict:
    """The reference's next-token log-probabilities where two greedy completions part: `margin`,
    its own token's minus the candidate's token's (what rounding would have to overturn), and
    `top_gap`, its top-1 minus top-2 (the same number when the candidate took the runner-up)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, 2).values
    return {"margin": float(lp[ref_token] - lp[cand_token]), "top_gap": float(top[0] - top[1]),
            "reference_token": int(ref_token), "candidate_token": int(cand_token)}


def judge_greedy(partings: list[dict], reach: float) -> dict:
    """Split the prompts whose greedy completions part into near-ties (the reference's margin
    there within `reach`, what the rounding can move) and disagreements (a larger margin: not
    rounding). Passed: no disagreement."""
    near = [{**d, "reach": reach} for d in partings if d["margin"] <= reach]
    real = [{**d, "reach": reach} for d in partings if d["margin"] > reach]
    return {"near_ties": near, "disagreements": real, "passed": not real}
