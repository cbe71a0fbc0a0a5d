"""Tokenised sources on disk, keyed by fingerprint, as plain numpy arrays (no pickle).

A source's tokens live in one directory per fingerprint:

    ids.npy      int32  every example's token ids, concatenated
    mask.npy     uint8  1 where the token is trained (labels == ids), 0 where it is IGNORE
    offsets.npy  int64  example i is ids[offsets[i]:offsets[i+1]]
    meta.json    counts (rows read, skipped, truncated, filtered) and the first bad-row messages

The arrays are opened memory-mapped (`np.load(mmap_mode="r", allow_pickle=False)`), so a
large source costs page cache, not process memory, and a re-run or resume does not
re-tokenise. Entries are written through workbench/core/cache.py (one writer, sealed, renamed into
place), so a killed run never leaves a half-written entry that a later run would trust.

    TokenArrays.build(chunks)   # from (ids, labels) pairs
    save(dir, arrays, meta) / load(dir) -> (TokenArrays, meta) | None
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from workbench.core import cache as workbench_cache
from workbench.core.secrets import redact
from workbench.data.chat import IGNORE


class TokenArrays:
    """A read-only sequence of (input_ids, labels) examples backed by flat arrays."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, offsets: np.ndarray):
        self.ids, self.mask, self.offsets = ids, mask, offsets

    @classmethod
    def empty(cls) -> TokenArrays:
        return cls(np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(1, np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def arrays(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = np.asarray(self.ids[a:b], dtype=np.int64)
        return ids, np.where(np.asarray(self.mask[a:b], dtype=bool), ids, IGNORE)

    def __getitem__(self, i: int) -> tuple[list[int], list[int]]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        ids, labels = self.arrays(i)
        return ids.tolist(), labels.tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def trained_tokens(self) -> int:
        return int(np.count_nonzero(self.mask))


class ArrayBuilder:
    """Accumulates examples in growing numpy chunks (no per-token Python lists kept around)."""

    def __init__(self):
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._lens: list[int] = []

    def add(self, ids: list[int], labels: list[int]) -> None:
        a = np.asarray(ids, dtype=np.int32)
        self._ids.append(a)
        self._mask.append(np.asarray(labels, dtype=np.int64) != IGNORE)
        self._lens.append(len(ids))

    def __len__(self) -> int:
        return len(self._lens)

    def build(self) -> TokenArrays:
        if not self._lens:
            return TokenArrays.empty()
        offsets = np.zeros(len(self._lens) + 1, np.int64)
        np.cumsum(self._lens, out=offsets[1:])
        return TokenArrays(np.concatenate(self._ids), np.concatenate(self._mask).astype(np.uint8), offsets)


FILES = ("ids.npy", "mask.npy", "offsets.npy", "meta.json")


def default_dir() -> Path:
    return workbench_cache.root() / "tokenised"


def save(directory: Path, arrays: TokenArrays, meta: dict) -> None:
    """Publish the entry once (workbench/core/cache.py: one writer, sealed, renamed into place)."""

    def make(tmp: Path) -> None:
        np.save(tmp / "ids.npy", np.ascontiguousarray(arrays.ids, dtype=np.int32))
        np.save(tmp / "mask.npy", np.ascontiguousarray(arrays.mask, dtype=np.uint8))
        np.save(tmp / "offsets.npy", np.ascontiguousarray(arrays.offsets, dtype=np.int64))
        # the bad-row messages quote rows and the source names a path or URL: scrubbed like a log
        (tmp / "meta.json").write_text(json.dumps(redact(meta), indent=1))

    workbench_cache.build(Path(directory), make, "tokenised source", FILES)


def load(directory: Path) -> tuple[TokenArrays, dict] | None:
    """The cached arrays and meta, or None when absent or not sealed complete (then it is rebuilt)."""
    directory = Path(directory)
    if workbench_cache.problem(directory, FILES) is not None:
        return None
    try:
        meta = json.loads((directory / "meta.json").read_text())
        arrs = [np.load(directory / f"{k}.npy", mmap_mode="r", allow_pickle=False) for k in ("ids", "mask", "offsets")]
    except (OSError, ValueError):
        return None
    ids, mask, offsets = arrs
    if len(ids) != len(mask) or len(offsets) < 1 or int(offsets[-1]) != len(ids):
        return None
    return TokenArrays(ids, mask, offsets), meta


def load_twins(directory: Path, count: str, per_item: tuple[str, ...]) -> tuple[TokenArrays, dict] | None:
    """An entry of two sequences per item (a preference pair; a KTO row's prompt and completion):
    meta[count] items, 2 * meta[count] sequences, and a list of one value per item under each key
    of `per_item`. None when absent or of another shape (then it is rebuilt)."""
    hit = load(directory)
    if hit is None:
        return None
    arrays, meta = hit
    n = meta.get(count, -1)
    if len(arrays) != 2 * n or any(len(meta.get(k, ())) != n for k in per_item):
        return None
    return arrays, meta
