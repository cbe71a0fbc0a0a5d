"""Checkpoints: written to a temporary directory, renamed when complete, then `latest` moves.

    <output_dir>/checkpoints/step-00000040/
        model.safetensors     trainable weights (adapters only for LoRA)
        optim.pt              optimizer/scheduler/scaler state (loaded with weights_only=True)
        state.json            step, tokens, data position, RNG of this rank
    <output_dir>/checkpoints/latest   text file naming the newest complete checkpoint

A crash mid-save leaves a `.tmp` directory that is ignored; `latest` never points at a
partial checkpoint. Nothing here unpickles arbitrary objects.

Sharding backends (fsdp2, deepspeed) write their own files into the step directory on every
rank: their state dict is `{"writer": fn}` and `fn(tmp_dir)` may return a future (async save);
the checkpoint is then committed (renamed, `latest` moved) by `flush()` once it completes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def ckpt_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def latest(output_dir) -> Path | None:
    pointer = ckpt_root(output_dir) / "latest"
    if not pointer.exists():
        return None
    path = ckpt_root(output_dir) / pointer.read_text().strip()
    return path if (path / "state.json").exists() else None


def _rank_suffix(rank: int) -> str:
    return "" if rank == 0 else f".rank{rank}"


_PENDING: list = []  # (future, commit) of async saves not yet committed


def flush() -> None:
    """Wait for async saves and commit them (collective: every rank calls it)."""
    while _PENDING:
        future, commit = _PENDING.pop(0)
        future.result()
        commit()


def save(output_dir, step: int, backend_state: dict, meta: dict, rank: int = 0, world: int = 1,
         keep: int = 2, barrier=lambda: None) -> Path:
    flush()
    root = ckpt_root(output_dir)
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    sfx = _rank_suffix(rank)
    pending = None
    if "writer" in backend_state:  # the backend writes its own sharded files on every rank
        pending = backend_state["writer"](tmp)
    elif rank == 0 or backend_state.get("sharded"):
        weights = {k: v.detach().contiguous().cpu() for k, v in backend_state["model"].items()}
        save_file(weights, tmp / f"model{sfx}.safetensors")
        rest = {k: v for k, v in backend_state.items() if k not in ("model", "sharded")}
        torch.save(rest, tmp / f"optim{sfx}.pt")
    torch.save(meta.pop("rng"), tmp / f"rng{sfx}.pt")
    (tmp / f"state{sfx}.json").write_text(json.dumps(meta, indent=1))

    def commit():
        _commit(root, name, tmp, final, rank, keep, barrier)

    if pending is not None:
        _PENDING.append((pending, commit))
    else:
        commit()
    return final


def _commit(root: Path, name: str, tmp: Path, final: Path, rank: int, keep: int, barrier) -> None:
    barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = root / "latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, root / "latest")
        _prune(root, keep)
    barrier()


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, rank: int = 0, sharded: bool = False, external: bool = False) -> tuple[dict, dict]:
    """(backend state, meta). `external`: the backend reads its own files; state is {"path": path}."""
    sfx = _rank_suffix(rank) if sharded else ""
    if external:
        state = {"path": Path(path)}
    else:
        state = {"model": load_file(path / f"model{sfx}.safetensors")}
        state.update(torch.load(path / f"optim{sfx}.pt", weights_only=True))
    rsfx = _rank_suffix(rank)
    meta = json.loads((path / f"state{rsfx}.json").read_text())
    meta["rng"] = torch.load(path / f"rng{rsfx}.pt", weights_only=True)
    return state, meta
