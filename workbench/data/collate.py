"""Batch collation: right-padded batches, and packed rows without cross-example attention.

    pad_batch([(ids, labels), ...], pad_id)                        # one example per row
    pack_rows([[(ids, labels), ...], ...], pad_id, layout="rows")  # several examples per row

Both return input_ids, attention_mask, position_ids (packed only), `select` (positions whose
next token is trained) and `targets`, the inputs `SelectiveLM.forward` takes.

Packed rows reset position ids at every example and keep the examples apart:
- `mask="4d"`: a block-diagonal causal boolean mask (B x 1 x T x T), which SDPA applies as is
  (CPU and any GPU without flash-attention);
- `mask="position_ids"`: no mask at all; the model finds the example boundaries from the
  position ids (transformers does this for sdpa/eager, and flash-attention runs varlen on it).
`layout="flat"` concatenates every row into one padding-free sequence (1 x total tokens), the
shape flash-attention's varlen path wants; `layout="rows"` keeps R rows, right-padded only to
the longest row. The first token of every example is never a target, exactly as unpacked.
"""

from __future__ import annotations

import torch

from workbench.data.chat import IGNORE
from workbench.models.head import shift_targets


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict:
    """Pad (input_ids, labels) pairs to the longest; add the select mask and targets."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        attn[i, : len(x)] = 1
    select, targets = shift_targets(ids, labels)
    return {"input_ids": ids, "attention_mask": attn, "select": select, "targets": targets}


def pack_rows(rows: list[list[tuple[list[int], list[int]]]], pad_id: int, layout: str = "rows",
              mask: str = "4d") -> dict:
    """Collate packed rows (each a list of (ids, labels)) into one micro-batch."""
    if layout == "flat":
        rows = [[ex for row in rows for ex in row]]
    width = max(sum(len(x) for x, _ in row) for row in rows)
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)  # example index within the row; -1 = padding
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for k, (x, y) in enumerate(row):
            m = len(x)
            ids[r, at:at + m] = torch.as_tensor(x)
            labels[r, at:at + m] = torch.as_tensor(y)
            labels[r, at] = IGNORE  # nothing predicts an example's first token
            pos[r, at:at + m] = torch.arange(m)
            seg[r, at:at + m] = k
            at += m
        real += at
        # Padding is a segment of its own with fresh positions, so it never joins an example.
        pos[r, at:] = torch.arange(width - at)
    select, targets = shift_targets(ids, labels)
    batch = {"input_ids": ids, "position_ids": pos, "select": select, "targets": targets,
             "attention_mask": None, "real_tokens": real}
    if mask == "4d":
        same = seg.unsqueeze(2) == seg.unsqueeze(1)  # B x T x T
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        batch["attention_mask"] = (same & causal).unsqueeze(1)
    elif mask != "position_ids":
        raise ValueError(f"mask must be '4d' or 'position_ids', got {mask!r}")
    return batch
