"""Padding collation for token sequences with labels (right padding, labels masked)."""

from __future__ import annotations

import torch

from workbench.data.formats import IGNORE
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
