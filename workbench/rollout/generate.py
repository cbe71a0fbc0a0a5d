"""Batched generation with HF `generate` (KV cache), left-padded, with the model's end-of-turn.

Used by evaluation hooks and GRPO rollouts. The model is switched to eval mode with the KV
cache on for the call and restored afterwards.
"""

from __future__ import annotations

import torch

from workbench.data.formats import prompt_ids


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
                synced_gpus=synced,
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
