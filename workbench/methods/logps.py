"""Summed completion log-probs of a micro-batch's rows, laid out as preference pairs: what DPO,
KTO, CPO/SimPO and ORPO train on and the preference evaluations compare.

Two layouts of a micro-batch of N pairs:

    micro = collate(pairs, pad_id)           # 2N rows: every chosen, then every rejected
    micro = pair_tree.tree_batch(pairs, pad) # N rows, the prompt once (workbench/data/pair_tree.py)
    pi = pair_logps(model, micro)            # (2N,) either way: chosen then rejected
    pi_c, pi_r = pi.chunk(2)

`model` is a SelectiveLM (workbench/models/head.py): it returns logits only at the positions
`select` marks, so log-probs are summed over completion tokens without the full (rows, seq,
vocab) tensor. The two layouts give the same log-probs up to rounding.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workbench.data.collate import pad_batch
from workbench.data.pair_tree import takes_pairs, tree_batch
from workbench.data.preference import pairs_from_rows
from workbench.models.head import SelectiveLM
from workbench.train import sequence_parallel


def margin_loss(d: torch.Tensor, loss_type: str, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-pair loss on a preference margin `d` (chosen minus rejected; DPO's is relative to the
    reference, CPO's the policy's own): sigmoid, with label smoothing (conservative DPO), hinge
    (SLiC), or ipo (the squared distance to 1 / 2 beta). DPO and CPO/SimPO share it."""
    if loss_type == "hinge":
        return torch.relu(1 - beta * d)
    if loss_type == "ipo":
        return (d - 1 / (2 * beta)) ** 2
    e = label_smoothing
    return -(1 - e) * F.logsigmoid(beta * d) - e * F.logsigmoid(-beta * d)


def collate(pairs: list, pad_id: int) -> dict:
    """One micro-batch: rows [chosen_0..chosen_n-1, rejected_0..rejected_n-1]."""
    micro = pad_batch([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)
    micro["n_tokens"] = micro["select"].sum(dim=1)
    return micro


def sequence_logps(model, micro: dict) -> torch.Tensor:
    """Summed log-prob of each row's selected target tokens, shape (rows,)."""
    logp = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro.get("position_ids"), select=micro["select"], targets=micro["targets"])
    rows = micro["select"].nonzero()[:, 0]
    per_row = torch.zeros(micro["input_ids"].shape[0], dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)
    return sequence_parallel.total(per_row)  # under backend.sp: the rest of each row's tokens are on its sp group


def tree_token_logps(model, micro: dict) -> torch.Tensor:
    """Log-prob of each target of a pair_tree.tree_batch micro-batch (its row: micro["logp_rows"])."""
    # The last shared position's row is read twice (first chosen and first rejected token).
    return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro["position_ids"], select=micro["select"], targets=micro["targets"],
                 slot=micro["head_slot"])


def tree_logps(model, micro: dict) -> torch.Tensor:
    """sequence_logps of a pair_tree.tree_batch micro-batch: shape (2N,), chosen then rejected."""
    logp = tree_token_logps(model, micro)
    return torch.zeros(micro["n_tokens"].shape[0], dtype=logp.dtype, device=logp.device).index_add(
        0, micro["logp_rows"], logp)


def pair_logps(model, micro: dict) -> torch.Tensor:
    """Per-row log-probs (2N,) of either layout: tree rows (tree_batch) or two rows per pair (collate)."""
    return tree_logps(model, micro) if "head_slot" in micro else sequence_logps(model, micro)


@torch.no_grad()
def preference_accuracy(model, tokenizer, contract, rows: list[dict], batch_size: int = 16, autocast=None) -> float:
    """Share of held-out pairs where the model's log-prob of `chosen` beats `rejected` (model: HF/PEFT)."""
    pairs = pairs_from_rows(rows, tokenizer, contract)
    lm = SelectiveLM(model)
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    tree = takes_pairs(lm, pairs)
    wins = 0
    for i in range(0, len(pairs), batch_size):
        chunk, pad = pairs[i:i + batch_size], tokenizer.pad_token_id
        micro = tree_batch(chunk, pad) if tree else collate(chunk, pad)
        micro = {k: v.to(device) for k, v in micro.items() if isinstance(v, torch.Tensor)}
        with (autocast or contextlib.nullcontext()):
            c, r = pair_logps(lm, micro).chunk(2)
        wins += int((c > r).sum())
    model.train(was)
    return wins / max(1, len(pairs))
