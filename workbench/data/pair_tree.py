"""Preference pairs as one row each: the shared prompt once, then both completions as branches.

    micro = tree_batch(pairs, pad_id)        # N rows: [prefix | chosen rest | rejected rest]
    reason = tree_unsupported(lm, seq_len)   # None, or why a model must keep two rows per pair
    takes_pairs(lm, pairs)                   # whether these pairs can be scored as tree rows
    micro = prefix_tree(examples, pad_id, seq_len)   # SFT: examples sharing a prefix, one branch each

`collate` (workbench/methods/logps.py) makes 2N rows (every chosen, then every rejected), so the decoder reads each
prompt twice and every row is padded to the longest of the 2N. Here a pair is one row:

    tokens     p0 .. p(P-1) | c(P) .. c(Lc-1) | r(P) .. r(Lr-1) | pad
    positions  0  .. P-1    | P    .. Lc-1    | P    .. Lr-1    | 0, 1, ..
    sees       prefix,      | prefix and      | prefix and      | earlier padding
               causally     | earlier chosen  | earlier rejected|

P is the length of the longest common prefix of the two token sequences (the prompt, plus any
completion tokens the two share), so every token sees exactly the tokens and position ids it
sees in its own unshared row, and the hidden states are the unshared ones up to rounding.
The mask is a boolean B x 1 x T x T tensor that transformers hands to SDPA as is (the layout
of collate.pack_rows(mask="4d")). Padding attends to earlier padding only, so no query row is
fully masked (SDPA would return NaN there) and no real token reads it.

The head runs once per position some branch reads (`select`, a boolean mask, as SelectiveLM
takes it). The last shared position predicts both the first chosen and the first rejected
token: its one log-softmax row is read twice, through `head_slot` (which selected position
each target reads) and `targets`. `logp_rows` says which of the 2N sums (chosen 0..N-1, then
rejected 0..N-1) each target goes to, in the order logps.collate's rows produce them, so the
sums add the same terms in the same order as the two-row layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workbench.data.chat import IGNORE
from workbench.data.packing import PAD_FREE_SHARE, sliding_window
from workbench.models.head import SelectiveLM
from workbench.peft.lora import base_model
from workbench.train.distributed import is_main_process

# Attention kernels that apply a boolean 4-D mask as given (eager adds the mask to the scores,
# flash-attention takes no mask at all).
MASKED_KERNELS = ("sdpa",)


def shared_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences share (token ids here; messages for data/preference.py)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _branch(ids: list[int], labels: list[int], prefix: int, offset: int):
    """(row columns, targets) of one completion: positions t whose next label is trained."""
    lab = torch.as_tensor(labels)
    t = (lab[1:] != IGNORE).nonzero()[:, 0]
    return _column(t, prefix, offset), lab[1:][t]


def _column(t: torch.Tensor, prefix, offset) -> torch.Tensor:
    # Positions inside the shared prefix stay where they are; the rest of a branch is shifted
    # by `offset` columns (0 for the first branch, which follows the prefix directly).
    return torch.where(t < prefix, t, t + offset)


def common_prefix(seqs: list[list[int]]) -> int:
    """Tokens every sequence of a group starts with."""
    return min(shared_prefix(seqs[0], x) for x in seqs) if len(seqs) > 1 else len(seqs[0])


def branch_batch(groups: list[list[tuple[list[int], list[int]]]], pad_id: int) -> dict:
    """One row per group of (ids, labels) sequences sharing a prefix: the prefix once, then each
    sequence's rest as its own branch (the module docstring's layout with k branches; GRPO's
    completions of one prompt, or a pair). Targets come sequence by sequence, each by position:
    the order a padded batch of the sequences in order (collate.pad_batch) produces, so flat
    log-probs line up with it. `target_seq` is each target's sequence index, `n_tokens` each
    sequence's target count, `real_tokens` the tokens the model reads, and `seq_row`,
    `seq_prefix`, `seq_offset` where each sequence lies (`columns` reads them)."""
    n = len(groups)
    prefixes = [common_prefix([x for x, _ in g]) for g in groups]
    lengths = [len(g[0][0]) + sum(len(x) - s for x, _ in g[1:]) for g, s in zip(groups, prefixes)]
    width = max(lengths)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    seg = torch.full((n, width), -1, dtype=torch.long)  # 0 prefix, j+1 branch j, -1 padding
    rows, cols, targets, n_tokens, where = [], [], [], [], []
    for b, (g, s, end) in enumerate(zip(groups, prefixes, lengths)):
        at = s
        ids[b, :s] = torch.as_tensor(g[0][0][:s], dtype=torch.long)
        pos[b, :s] = torch.arange(s)
        seg[b, :s] = 0
        for j, (x, lab) in enumerate(g):
            rest = len(x) - s
            ids[b, at:at + rest] = torch.as_tensor(x[s:], dtype=torch.long)
            pos[b, at:at + rest] = torch.arange(s, len(x))
            seg[b, at:at + rest] = j + 1
            # positions inside the prefix stay; the rest of the branch is shifted to its columns
            c, t = _branch(x, lab, s, at - s)
            rows.append(torch.full_like(c, b))
            cols.append(c)
            targets.append(t)
            n_tokens.append(len(t))
            where.append((b, s, at - s))
            at += rest
        pos[b, end:] = torch.arange(width - end)
    rows_t, cols_t = torch.cat(rows), torch.cat(cols)
    select = torch.zeros((n, width), dtype=torch.bool)
    select[rows_t, cols_t] = True
    # The head's output rows are the selected positions in row-major order; slot[b, t] is the
    # output row of position (b, t).
    slot = (select.flatten().cumsum(0) - 1).view(n, width)
    q, k = seg.unsqueeze(2), seg.unsqueeze(1)  # B x T x 1, B x 1 x T
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    # Same segment (prefix, one branch, or padding), or a prefix key seen by a real token.
    mask = causal & ((q == k) | ((k == 0) & (q >= 0)))
    n_tok = torch.as_tensor(n_tokens, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask.unsqueeze(1), "position_ids": pos, "select": select,
            "head_slot": slot[rows_t, cols_t], "targets": torch.cat(targets),
            "target_seq": torch.repeat_interleave(torch.arange(len(n_tokens)), n_tok), "n_tokens": n_tok,
            "real_tokens": int((seg >= 0).sum()), **dict(zip(("seq_row", "seq_prefix", "seq_offset"),
                                                             torch.tensor(where, dtype=torch.long).t()))}


def prefix_tree(examples: list[tuple[list[int], list[int]]], pad_id: int, width: int) -> dict | None:
    """The micro-batch's examples as tree rows: the tokens they all start with (a system prompt, a
    template's opening) once per row, then each example's rest as its own branch that sees the
    prefix and itself only (workbench/data/pair_tree.py branch_batch, DPO's shared-prompt layout
    with one branch per example). Every token sees the tokens and position ids of its own row, so
    the loss and gradients are the padded batch's up to rounding (SFT's data.share_prefix). A row holds examples in order
    while it stays within `width` tokens (data.seq_len): attention's cost grows with the square
    of a row, and a row no longer than a planned one keeps the planner's memory an upper bound.
    None when the rows would read more than PAD_FREE_SHARE of the examples' own tokens (little
    in common), or there is one example."""
    if len(examples) < 2:
        return None
    shared = common_prefix([ids for ids, _ in examples])  # every row's prefix is at least this long
    groups, used = [[]], shared
    for ex in examples:
        rest = len(ex[0]) - shared
        if groups[-1] and used + rest > width:
            groups.append([])
            used = shared
        groups[-1].append(ex)
        used += rest
    real = sum(len(ids) for ids, _ in examples)
    if real - (len(examples) - len(groups)) * shared > PAD_FREE_SHARE * real:
        return None
    micro = branch_batch(groups, pad_id)
    for key in ("target_seq", "n_tokens", "seq_row", "seq_prefix", "seq_offset"):  # where each sequence lies:
        micro.pop(key)  # what pairs and GRPO read back; an SFT loss sums every target alike
    return micro


def columns(tree: dict, positions) -> torch.Tensor:
    """The column of token `positions[i]` of sequence i (branch_batch's order) in its row
    (`tree["seq_row"][i]`)."""
    return _column(torch.as_tensor(positions, dtype=torch.long), tree["seq_prefix"], tree["seq_offset"])


def tree_batch(pairs: list, pad_id: int, chosen_labels: list[list[int]] | None = None) -> dict:
    """One micro-batch of N rows (one per pair); see the module docstring for the keys.
    branch_batch orders targets pair by pair; dpo wants chosen 0..N-1, then rejected 0..N-1.
    chosen_labels: per pair, the labels the chosen branch is read with instead of its own
    (ORPO's NLL over the whole chosen sequence)."""
    n = len(pairs)
    labels = chosen_labels or [p.chosen[1] for p in pairs]
    out = branch_batch([[(p.chosen[0], lab), p.rejected] for p, lab in zip(pairs, labels)], pad_id)
    seq = out.pop("target_seq")  # 2b + side
    order = torch.sort((seq % 2) * n + seq // 2, stable=True)  # chosen rows first, each by position
    out["head_slot"], out["targets"] = out["head_slot"][order.indices], out["targets"][order.indices]
    out["logp_rows"] = order.values
    out["n_tokens"] = out["n_tokens"].view(n, 2).t().reshape(-1)
    return out


def tree_fits(module, seq_len: int, fallback: str) -> bool:
    """Whether `module` takes tree rows; if not, rank 0 says why on stderr and what the method
    does instead (`fallback`)."""
    import sys


    reason = tree_unsupported(module, seq_len)
    if reason and is_main_process():
        print(f"note: method.share_prompt: {reason}; {fallback}", file=sys.stderr)
    return reason is None


def takes_pairs(module, pairs: list) -> bool:
    """Whether `module` can score these pairs as tree rows (the held-out evaluations: the
    longest completion of any pair bounds the window a sliding-window model would need)."""
    longest = max((max(len(p.chosen[0]), len(p.rejected[0])) for p in pairs), default=0)
    return tree_unsupported(module, longest) is None


def tree_unsupported(module, seq_len: int) -> str | None:
    """Why `module` cannot take tree rows (None when it can).

    Needs a SelectiveLM that splits decoder and head, an attention kernel that applies a 4-D
    boolean mask as given (MASKED_KERNELS), and no sliding window that could bite: transformers
    applies a custom 4-D mask as is on every layer, so a window shorter than `seq_len` (the
    longest sequence a pair can have) would be dropped.
    """
    if not isinstance(module, SelectiveLM):
        return f"the backend's model is a {type(module).__name__}, not a SelectiveLM"
    if not module._split:
        return "this model family computes its logits in its own forward (no separate decoder and head)"
    return config_unsupported(getattr(base_model(module.inner), "config", None), seq_len)


def config_unsupported(config, seq_len: int) -> str | None:
    """Why a decoder with this config cannot read tree rows of up to `seq_len` tokens (None when
    it can): tree_unsupported's attention and window conditions."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in MASKED_KERNELS:
        return f"attention {impl!r} does not take a 4-D mask (needs one of {list(MASKED_KERNELS)})"
    window = sliding_window(config)
    if window and window < seq_len:
        return f"sliding-window attention ({window} tokens) shorter than the sequences ({seq_len})"
    return None
