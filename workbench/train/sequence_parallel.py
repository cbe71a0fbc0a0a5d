"""Sequence parallelism (`backend.sp=N`): each rank of an sp group holds 1/N of every row's tokens.

    python -m workbench backend.sp=2 hardware.procs=2 data.packing=true data.seq_len=4096
    python -m workbench backend=fsdp2 backend.sp=2 hardware.procs=4   # dp=2 x sp=2

The mechanism is DeepSpeed-Ulysses' as verl and ms-swift apply it to Hugging Face models: the
decoder runs on a slice of the sequence, and inside every attention layer an all-to-all trades
the slice of tokens for a slice of heads, so each rank attends over the whole sequence for its
heads, then a second all-to-all trades back. Everything else in a block (norms, MLP, rotary
embeddings from the slice's own position ids) is per token and needs no communication.

- `setup(sp)` makes the sp groups (consecutive ranks: the data-parallel rank is rank // sp,
  workbench/train/layout.py) and registers `attention` with transformers' AttentionInterface;
  `install(model)` points the model's layers at it.
- `rows(micro)` (the backends' accumulate, workbench/backends/step.py) pads every row to a
  multiple of sp, records where its documents and real tokens are (packed rows restart their
  position ids per document, and no token attends across documents or to padding), and gives the
  rank its slice: per-position tensors cut along the sequence, per-target tensors (whose order is
  micro["select"]'s) kept where their position falls in the slice. Targets were computed on the
  whole row before the cut, so the last token of a slice still learns the next slice's first.
- `total(x)`: a sum over the row's tokens, completed over the sp group (all-reduce forward and
  backward). Every loss adds its per-token terms through it, so each sp rank holds the whole
  row's loss; the backends' accumulate needs no change (its denominator counts each row once per
  sp rank, and the gradient all-reduce sums sp copies, which cancel).

Heads need not divide by sp: the all-to-all sends uneven head slices (9 heads over 2 ranks: 5
and 4). Key/value heads are split with them where both counts divide, else repeated to one per
query head first (more traffic, the same result). The attention itself is PyTorch's SDPA with a
boolean mask of the whole sequence, so any softmax-attention decoder without soft-capping or a
sliding window shorter than the row trains under it; the rules (workbench/resolve/rules.py) refuse
the rest before weights load.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench.core.errors import UserError

NAME = "workbench_sp"  # the attention implementation's name in transformers' registries

# per-position tensors of a micro-batch, (rows, seq) or (rows, seq, ...): cut along the sequence
PER_POSITION = ("input_ids", "position_ids", "select", "labels", "loss_mask")
# per-target tensors, one entry per True of micro["select"] in row-major order: kept where their
# position falls in this rank's slice
PER_TARGET = ("targets", "target_seq", "old_logps", "ref_logps", "completion")


@dataclass
class _Group:
    size: int
    rank: int
    group: object


_GROUP: _Group | None = None


@dataclass
class _Rows:
    """The whole rows the current slices belong to: what the attention's mask is made of."""

    doc: torch.Tensor  # (rows, seq) document index within each row
    real: torch.Tensor  # (rows, seq) bool: a real token (padding is never attended to)
    mask: torch.Tensor | None = None  # (rows, 1, seq, seq) bool, built on first use

    def __post_init__(self):
        # One document per row and padding only after it: the causal mask alone is exact (no real
        # token attends to the padding after it), and SDPA needs no (seq x seq) mask.
        one_doc = bool(((self.doc == self.doc[:, :1]) | ~self.real).all())
        self.causal = one_doc and bool((self.real[:, 1:] <= self.real[:, :-1]).all())

    def attend(self) -> torch.Tensor | None:
        """The whole rows' mask, or None where the causal mask alone is exact."""
        if self.mask is None and not self.causal:
            seq = self.doc.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=self.doc.device).tril()
            same = self.doc[:, :, None] == self.doc[:, None, :]
            # a padding query attends to itself only, so no row of the softmax is empty
            own = torch.eye(seq, dtype=torch.bool, device=self.doc.device)
            self.mask = ((causal & same & self.real[:, None, :]) | own).unsqueeze(1)
        return self.mask


_ROWS: _Rows | None = None


def setup(sp: int) -> None:
    """Make this process's sp group (collective over all ranks) and register the attention."""
    global _GROUP
    if sp <= 1:
        _GROUP = None
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sp:
        raise ValueError(f"backend.sp={sp} does not divide the world size {world}")
    mine = None
    for start in range(0, world, sp):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(start, start + sp)))
        if start <= rank < start + sp:
            mine = g
    _GROUP = _Group(size=sp, rank=rank % sp, group=mine)
    _register()


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    # Outside a sliced forward (generation, evaluation, the replay probe) the layers get the mask
    # SDPA would and run SDPA on the whole rows.
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def install(model: torch.nn.Module) -> None:
    """Point every config under `model` at the sp attention (a no-op without sp); a UserError for
    attention it cannot stand in for."""
    if _GROUP is None:
        return
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            why = unsupported(cfg)
            if why:
                raise UserError(f"backend.sp={_GROUP.size}: {why}; use backend.sp=1")
            cfg._attn_implementation = NAME


def unsupported(config) -> str | None:
    """Why this decoder's attention is not plain softmax attention over the whole row (None if it is)."""
    if getattr(config, "attn_logit_softcapping", None):
        return f"{config.model_type} soft-caps its attention scores, which SDPA does not"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if window and ("sliding_attention" in layer_types or (not layer_types and getattr(config, "use_sliding_window", True))):
        return f"{config.model_type} attends over a sliding window of {window} tokens, not the whole row"
    return None


def start(sp: int, model: torch.nn.Module) -> None:
    """setup, then install: what a backend's wrap calls once the process group runs."""
    setup(sp)
    install(model)


@contextlib.contextmanager
def rows(micro: dict):
    """This rank's slice of `micro` for one forward and its backward (the micro itself without sp)."""
    global _ROWS
    if _GROUP is None:
        yield micro
        return
    local, _ROWS = _slice(micro, _GROUP.size, _GROUP.rank)
    try:
        yield local
    finally:
        _ROWS = None


def _slice(micro: dict, sp: int, rank: int) -> tuple[dict, _Rows]:
    ids = micro["input_ids"]
    n_rows, seq = ids.shape
    pad = (-seq) % sp
    full = seq + pad
    mask = micro.get("attention_mask")
    real = (mask.bool() if mask is not None and mask.dim() == 2
            else torch.ones(n_rows, seq, dtype=torch.bool, device=ids.device))
    pos = micro.get("position_ids")
    if pos is None:
        pos = torch.arange(seq, device=ids.device).expand(n_rows, seq)
    # a document starts where the position ids do not continue the previous token's
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    doc = starts.long().cumsum(1)
    if pad:
        real = F.pad(real, (0, pad), value=False)
        doc = F.pad(doc, (0, pad), value=-1)
    width = full // sp
    lo, hi = rank * width, (rank + 1) * width
    out = {}
    select = micro.get("select")
    if select is not None:
        where = select.nonzero()[:, 1]  # each target's position, in the targets' order
        keep = (where >= lo) & (where < hi)
    for k, v in micro.items():
        if k in PER_POSITION and isinstance(v, torch.Tensor):
            out[k] = (F.pad(v, (0, pad)) if pad else v)[:, lo:hi]
        elif k in PER_TARGET and isinstance(v, torch.Tensor):
            out[k] = v[keep]
        elif k != "attention_mask":
            out[k] = v
    out["position_ids"] = (F.pad(pos, (0, pad)) if pad else pos)[:, lo:hi]
    out["attention_mask"] = None  # the attention reads the whole rows' layout instead
    return out, _Rows(doc=doc, real=real)


# torch's differentiable collectives (torch.distributed.nn.functional) are deprecated for private
# ones; the two this module needs are a few lines each.
class _Sum(torch.autograd.Function):
    """All-reduce sum over a group; its gradient is the all-reduce sum of the incoming ones."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Exchange(torch.autograd.Function):
    """all_to_all_single along dim 0 with split sizes; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return back, None, None, None


def total(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the sp group, the gradient summed back (x itself without sp)."""
    if _GROUP is None or _ROWS is None:
        return x
    return _Sum.apply(x, _GROUP.group)


def shares(n: int, sp: int) -> list[int]:
    """`n` heads over `sp` ranks, the first ranks taking one more where it does not divide."""
    return [n // sp + (r < n % sp) for r in range(sp)]


def _seq_to_heads(x: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """(rows, H, seq/sp, d) on every rank -> (rows, heads[rank], seq, d): all tokens, some heads."""
    g = _GROUP
    n_rows, _, width, d = x.shape
    mine = heads[g.rank]
    send = x.permute(1, 0, 2, 3)  # heads first: all_to_all_single splits dim 0
    got = _Exchange.apply(send, heads, [mine] * g.size, g.group)
    # (sp * mine, rows, width, d): rank r's tokens for my heads, in rank (= sequence) order
    return got.view(g.size, mine, n_rows, width, d).permute(2, 1, 0, 3, 4).reshape(n_rows, mine, g.size * width, d)


def _heads_to_seq(y: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """(rows, heads[rank], seq, d) -> (rows, H, seq/sp, d): the inverse of _seq_to_heads."""
    g = _GROUP
    n_rows, mine, seq, d = y.shape
    width = seq // g.size
    send = y.reshape(n_rows, mine, g.size, width, d).permute(2, 1, 0, 3, 4).reshape(g.size * mine, n_rows, width, d)
    return _Exchange.apply(send, [mine] * g.size, heads, g.group).permute(1, 0, 2, 3)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The layers' attention under sp: (rows, heads, seq/sp, d) in, (rows, seq/sp, heads, d) out."""
    if _ROWS is None:  # a whole-row forward: SDPA as the model would run it
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    sp, n_q, n_kv = _GROUP.size, query.shape[1], key.shape[1]
    if n_kv != n_q and (n_kv % sp or n_q % sp):  # grouped heads that cannot be split together
        key = key.repeat_interleave(n_q // n_kv, dim=1)
        value = value.repeat_interleave(n_q // n_kv, dim=1)
        n_kv = n_q
    q = _seq_to_heads(query, shares(n_q, sp))
    k = _seq_to_heads(key, shares(n_kv, sp))
    v = _seq_to_heads(value, shares(n_kv, sp))
    mask = _ROWS.attend()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=dropout,
                                         scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
    return _heads_to_seq(out, shares(n_q, sp)).transpose(1, 2).contiguous(), None
