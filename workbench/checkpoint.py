"""Checkpoints: written to a temporary directory, renamed when complete, then `latest` moves.

    <output_dir>/checkpoints/step-00000040/
        model.safetensors     trainable weights (adapters only for LoRA)
        optim.pt              optimizer/scheduler/scaler state (loaded with weights_only=True)
        state.json            step, tokens, data position, RNG of this rank
    <output_dir>/checkpoints/latest   text file naming the newest complete checkpoint

A crash mid-save leaves a `.tmp` directory that is ignored; `latest` never points at a
partial checkpoint. Nothing here unpickles arbitrary objects.
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


def save(output_dir, step: int, backend_state: dict, meta: dict, rank: int = 0, world: int = 1,
         keep: int = 2, barrier=lambda: None) -> Path:
    root = ckpt_root(output_dir)
    name = f"step-{step:08d}"
    final, tmp = root / name, root / f"{name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    sfx = _rank_suffix(rank)
    if rank == 0 or backend_state.get("sharded"):
        weights = {k: v.detach().contiguous().cpu() for k, v in backend_state["model"].items()}
        save_file(weights, tmp / f"model{sfx}.safetensors")
        rest = {k: v for k, v in backend_state.items() if k not in ("model", "sharded")}
        torch.save(rest, tmp / f"optim{sfx}.pt")
    torch.save(meta.pop("rng"), tmp / f"rng{sfx}.pt")
    (tmp / f"state{sfx}.json").write_text(json.dumps(meta, indent=1))
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
    return final


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, rank: int = 0, sharded: bool = False) -> tuple[dict, dict]:
    sfx = _rank_suffix(rank) if sharded else ""
    state = {"model": load_file(path / f"model{sfx}.safetensors")}
    state.update(torch.load(path / f"optim{sfx}.pt", weights_only=True))
    rsfx = _rank_suffix(rank)
    meta = json.loads((path / f"state{rsfx}.json").read_text())
    meta["rng"] = torch.load(path / f"rng{rsfx}.pt", weights_only=True)
    return state, meta
