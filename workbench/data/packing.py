"""Best-fit-decreasing packing of examples into rows of `seq_len` tokens, with no cross-talk.

    bins = best_fit_decreasing(lengths, capacity=256)             # list of lists of indices
    packer = Packer(mixture, lengths_of, seq_len)                 # one training stream
    rows = packer.next_rows(16)                                   # 16 rows, each a list of (src, row)

Examples packed into one row never attend to each other: the collator (collate.pack_rows)
resets position ids at each example and builds a block-diagonal causal mask, so a packed
step computes the same loss as the same examples unpacked.

`Packer` keeps training exactly resumable: it draws from the deterministic `Mixture`, packs
a pool a little larger than the step's capacity, and carries the examples that did not fit
into the next step (in draw order). Its state is the mixture's plus that carry list of
(source, row) indices, so a resumed run reads no row twice and skips none.
"""

from __future__ import annotations

import bisect

from workbench.data.collate import pack_rows

# Pool tokens drawn per step, relative to the step's capacity: the surplus is what lets
# best-fit fill the tail of every row; it is carried over, never dropped.
POOL_SLACK = 1.15


def best_fit_decreasing(lengths: list[int], capacity: int, max_bins: int | None = None):
    """(bins, left): indices placed longest-first into the fullest bin they fit; `left` did not fit.

    Remaining capacities are kept in a sorted list with a stack of bins per capacity, so each
    placement is a bisect (O(log n)) plus a small memmove, not a scan over all bins.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []  # sorted distinct remaining capacities that have at least one bin
    at: dict[int, list[int]] = {}  # remaining capacity -> bins with it
    left: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"example of {n} tokens exceeds the row capacity {capacity}")
        k = bisect.bisect_left(free, n)
        if k < len(free):
            room = free[k]
            b = at[room].pop()
            if not at[room]:
                del at[room]
                free.pop(k)
        elif max_bins is None or len(bins) < max_bins:
            b, room = len(bins), capacity
            bins.append([])
        else:
            left.append(i)
            continue
        bins[b].append(i)
        room -= n
        if room > 0:
            if room not in at:
                at[room] = []
                bisect.insort(free, room)
            at[room].append(b)
    return bins, sorted(left)


def fill_fraction(lengths: list[int], capacity: int) -> float:
    """Real tokens over row capacity when all `lengths` are packed (the padding cost of packing)."""
    bins, _ = best_fit_decreasing(lengths, capacity)
    return sum(lengths) / (len(bins) * capacity) if bins else 0.0


class Packer:
    """Step-wise packing over a Mixture stream, exactly resumable."""

    def __init__(self, mixture, length_of, seq_len: int):
        self.mixture = mixture
        self.length_of = length_of  # (src, row) -> token count
        self.seq_len = seq_len
        self.carry: list[tuple[int, int]] = []
        self.real_tokens = 0
        self.row_capacity = 0

    def next_rows(self, n_rows: int) -> list[list[tuple[int, int]]]:
        """The next `n_rows` packed rows; every row holds at least one example."""
        pool = list(self.carry)
        tokens = sum(self.length_of(x) for x in pool)
        want = n_rows * self.seq_len * POOL_SLACK
        while tokens < want or len(pool) < n_rows:
            x = self.mixture.next()
            pool.append(x)
            tokens += self.length_of(x)
        lengths = [self.length_of(x) for x in pool]
        bins, left = best_fit_decreasing(lengths, self.seq_len, max_bins=n_rows)
        self.carry = [pool[i] for i in left]
        # Rows keep the draw order of their examples, so a row reads like the stream it came from.
        rows = [[pool[i] for i in sorted(b)] for b in bins]
        used = sum(lengths) - sum(lengths[i] for i in left)
        self.real_tokens += used
        self.row_capacity += n_rows * self.seq_len
        return rows

    def fill(self) -> float:
        return self.real_tokens / self.row_capacity if self.row_capacity else 0.0

    def state_dict(self) -> dict:
        return {"carry": [list(x) for x in self.carry], "real_tokens": self.real_tokens,
                "row_capacity": self.row_capacity}

    def load_state_dict(self, state: dict) -> None:
        self.carry = [tuple(x) for x in state["carry"]]
        self.real_tokens = int(state.get("real_tokens", 0))
        self.row_capacity = int(state.get("row_capacity", 0))


# data.pad_free: a micro-batch is packed when its rows would hold at most this share of the
# padded batch's positions. Packed rows attend through a block-diagonal mask, which costs SDPA
# about what the padded path's mask does per position, so the gain is the positions saved; the
# margin keeps near-uniform batches (the embedded arithmetic rows, 49-50 tokens) on the padded
# layout every other path uses.
PAD_FREE_SHARE = 0.8


def pad_free(examples: list[tuple[list[int], list[int]]], pad_id: int, layout: str, mask: str) -> dict | None:
    """The micro-batch's own examples (nothing carried to or from other steps) in as few rows
    as the longest of them allows, best-fit-decreasing, with no cross-example attention: the
    same targets and loss as the padded batch. None when that saves under 1 - PAD_FREE_SHARE of
    the positions (uniform lengths)."""
    lengths = [len(ids) for ids, _ in examples]
    width = max(lengths)
    padded = len(examples) * width
    if layout == "flat":  # one varlen sequence (flash-attention)
        positions, rows = sum(lengths), [examples]
    else:
        bins, _ = best_fit_decreasing(lengths, width)
        positions, rows = len(bins) * width, [[examples[i] for i in b] for b in bins]
    if positions > PAD_FREE_SHARE * padded:
        return None
    return pack_rows(rows, pad_id, layout, mask)


def attention_layout(attn_implementation: str | None, window: int | None = None) -> tuple[str, str]:
    """(layout, mask) for packed rows: flash-attention wants one varlen sequence, SDPA a 4D mask.
    A model with sliding-window layers (`window`: `sliding_window(config)`) gets position ids
    instead: transformers applies the window only to masks it builds itself (from the position
    ids it finds each example's start), and a 4D mask handed in would let its sliding layers
    attend past the window (tests/unit/test_data_packing.py, a tiny Gemma 3 with a 4-token window)."""
    if attn_implementation and "flash" in attn_implementation:
        return "flat", "position_ids"
    if attn_implementation == "eager" or window:
        return "rows", "position_ids"  # eager adds the mask to scores; let the model build it
    return "rows", "4d"


def sliding_window(config) -> int | None:
    """The window of a decoder with sliding-window layers (Gemma 2/3's local layers, Mistral's
    configured window), in tokens; None when every layer attends over the whole row."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (not layer_types and getattr(config, "use_sliding_window", True))
    return int(window) if window and sliding else None


def packed_micro_batches(rows, example_of, micro_size: int, pad_id: int, layout: str, mask: str
                         ) -> tuple[list[dict], int]:
    """This rank's packed rows (its slice of the global batch, mixing.rank_share), collated into
    micro-batches of `micro_size` rows; and their real tokens."""
    micro, real = [], 0
    for i in range(0, len(rows), micro_size):
        m = pack_rows([[example_of(x) for x in row] for row in rows[i:i + micro_size]], pad_id, layout, mask)
        real += m.pop("real_tokens")
        micro.append(m)
    return micro, real
