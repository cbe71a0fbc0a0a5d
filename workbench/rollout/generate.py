"""Batched generation with HF `generate` (KV cache), left-padded, with the model's end-of-turn.

Used by evaluation hooks and GRPO rollouts. The model is switched to eval mode with the KV
cache on for the call and restored afterwards.

Sampling draws each token by the Gumbel-max rule (argmax of the warped logits plus Gumbel
noise), which picks token i with exactly probability softmax(logits)_i, like HF's own
multinomial draw. It is used because it is stable under rounding: the multinomial draw inverts
a cumulative sum over the whole vocabulary, so a last-bit difference in the logits (another
CPU's matmul kernels, another thread count) moves every boundary of that sum and flips about
one draw in a thousand on a flat distribution; an argmax flips only when the top two perturbed
scores are within rounding of each other. Rollouts, and so GRPO runs, then repeat on any machine.
"""

from __future__ import annotations

import torch

from workbench.data.formats import prompt_ids


def gumbel_max():
    """A logits processor that makes the draw deterministic given the noise: all mass on
    argmax(scores + Gumbel noise). It runs after HF's temperature and top-p warpers."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class GumbelMax(LogitsProcessor):
        def __call__(self, input_ids, scores):
            u = torch.rand(scores.shape, device=scores.device, dtype=torch.float32)
            u = u.clamp_(torch.finfo(torch.float32).tiny, 1.0 - torch.finfo(torch.float32).eps)
            pick = (scores.float() - torch.log(-torch.log(u))).argmax(-1, keepdim=True)
            out = torch.full_like(scores, float("-inf"))
            return out.scatter_(-1, pick, 0.0)

    return LogitsProcessorList([GumbelMax()])


@torch.no_grad()
def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, eot_id: int,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             num_return_sequences: int = 1, autocast=None, synced: bool = False) -> list[list[int]]:
    """Completion token ids (end-of-turn and padding stripped) for each conversation.

    synced: every rank keeps stepping until all ranks are done (parameters sharded over ranks)."""
    prompts = [prompt_ids(tokenizer, c) for c in conversations]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    cfg = getattr(model, "config", None)
    old_cache = getattr(cfg, "use_cache", None)
    if cfg is not None:
        cfg.use_cache = True
    try:
        import contextlib

        with (autocast or contextlib.nullcontext()):
            out = model.generate(
                input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                do_sample=do_sample, temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None, top_k=None,
                num_return_sequences=num_return_sequences, eos_token_id=eot_id, pad_token_id=pad,
                synced_gpus=synced, logits_processor=gumbel_max() if do_sample else None,
            )
    finally:
        if cfg is not None:
            cfg.use_cache = old_cache
        model.train(was_training)
    completions = []
    for row in out[:, width:].tolist():
        if eot_id in row:
            row = row[: row.index(eot_id)]
        completions.append([t for t in row if t != pad])
    return completions
