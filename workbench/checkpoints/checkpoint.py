"""Checkpoints: written to a temporary directory, checksummed, published whole
(workbench/core/atomic.py: fsynced, renamed into place), then `latest` moves.

    <output_dir>/checkpoints/step-00000040/
        canonical/            trainable weights and optimizer state under Hugging Face names, one
                              safetensors file per writing rank (workbench/checkpoints/canonical.py):
                              any backend at any world size reads it
        train.json            step, global samples, data position, LR schedule, the layout that wrote
                              it, the model/adapter/tokenizer it belongs to, the replay probe
        rng.pt, rng.rankN.pt  each rank's RNG (restored only at the same layout)
        rollouts.pt, ...      each rank's rollouts already generated for the next steps, when the
                              method has any (GRPO; restored only at the same layout)
        files.json            every other file of the checkpoint with its size and sha256
    <output_dir>/checkpoints/latest   text file naming the newest complete checkpoint

A crash mid-save leaves a `.tmp` directory that is ignored. On resume (`latest_valid`) the
checkpoint `latest` names is checked against `files.json` (sizes and sha256); a truncated,
missing or changed file makes it fall back to the newest older one that checks out, saying
which and why (`train.resume=<dir>` is checked the same way and refused with the reason). A
write that fails (disk full) removes its `.tmp`, leaves the previous checkpoint as it was and
stops the run with `CheckpointWriteError`, naming the checkpoint a resume will use. Nothing
here unpickles arbitrary objects. Tests: tests/integration/test_faults.py.

The tensors are written by the backend on every rank (`Backend.save_canonical`), which may
return a future (async save); the checkpoint is then committed (checksummed, renamed, `latest`
moved) by `flush()` once it completes. Step directories from before the canonical format
(state.json, model.safetensors / dcp/ / zero/) are still read, at the layout that wrote them
(`legacy_layout`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from workbench.core import atomic
from workbench.core.errors import UserError
from workbench.train.distributed import is_main_process

FILES = "files.json"
TRAIN = "train.json"  # the run's state at the step, one file for all ranks
CANONICAL = "canonical"  # the tensors (workbench/checkpoints/canonical.py)
LEGACY = "state.json"  # rank 0's state in step directories from before the canonical format


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, permissions); the previous one is intact."""


def ckpt_root(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def _step_dirs(root: Path) -> list[Path]:
    """Committed step directories, newest first."""
    return sorted((p for p in root.glob("step-*") if p.is_dir() and not atomic.aside(p)),
                  key=lambda p: p.name, reverse=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _inventory(folder: Path) -> dict:
    """{relative path: {size, sha256}} of every file under `folder` (what `verify` checks)."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != FILES)}


def verify(path: Path) -> str | None:
    """Why the checkpoint at `path` is unusable, or None when every file matches its record."""
    path = Path(path)
    state = path / TRAIN if (path / TRAIN).is_file() or not (path / LEGACY).is_file() else path / LEGACY
    if not state.is_file():
        return f"{TRAIN} is missing"
    listing = path / FILES
    if not listing.is_file():
        try:  # checkpoints from before files.json existed carry no "integrity" mark
            marked = "integrity" in json.loads(state.read_text())
        except (OSError, ValueError):
            return f"{state.name} is unreadable"
        return f"{FILES} is missing" if marked else None
    try:
        files = json.loads(listing.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return f"{FILES} is unreadable"
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != rec["size"]:
            return f"{name} is truncated or changed ({size} bytes, recorded {rec['size']})"
        if _sha256(f) != rec["sha256"]:
            return f"{name} does not match its sha256"
    return None


def _say(msg: str) -> None:
    if is_main_process():
        print(msg, file=sys.stderr, flush=True)


def _candidates(root: Path) -> list[Path]:
    """The checkpoint `latest` names, then the older ones, newest first. Without a readable
    pointer (or when it names nothing), every committed checkpoint, newest first."""
    dirs = _step_dirs(root)
    try:
        named = (root / "latest").read_text().strip()
    except OSError:
        named = ""
    if named and (root / named).is_dir():
        return [root / named] + [p for p in dirs if p.name < named]
    return dirs


def latest_valid(output_dir) -> Path | None:
    """The checkpoint `latest` names if it verifies, else the newest older one that does; each
    one passed over is reported with the reason."""
    rejected = []
    for path in _candidates(ckpt_root(output_dir)):
        why = verify(path)
        if why is None:
            if rejected:
                _say(f"warning: resuming from {path.name}: " + "; ".join(
                    f"{p.name} is unusable ({r})" for p, r in rejected))
            return path
        rejected.append((path, why))
    if rejected:
        _say("warning: no usable checkpoint, starting from step 0: " + "; ".join(
            f"{p.name} is unusable ({r})" for p, r in rejected))
    return None


def latest(output_dir) -> Path | None:
    """The checkpoint `train.resume=auto` continues from (see `latest_valid`)."""
    return latest_valid(output_dir)


def resume_point(output_dir, mode: str) -> Path | None:
    """What `train.resume` names: auto -> the newest checkpoint that verifies, never -> None,
    a path -> that checkpoint, refused with the reason when it does not verify."""
    if mode == "never":
        return None
    if mode == "auto":
        return latest_valid(output_dir)
    why = verify(Path(mode))
    if why is not None:
        raise UserError(f"train.resume={mode}: not a usable checkpoint ({why})")
    return Path(mode)


def _rank_suffix(rank: int) -> str:
    return "" if rank == 0 else f".rank{rank}"


_PENDING: list = []  # (future, commit) of async saves not yet committed


def flush() -> None:
    """Wait for async saves and commit them (collective: every rank calls it)."""
    while _PENDING:
        future, commit = _PENDING.pop(0)
        try:
            future.result()
        except OSError as exc:
            commit.abort(exc)
        commit()


def _write_failed(root: Path, name: str, tmp: Path, exc: OSError) -> CheckpointWriteError:
    """Remove the partial checkpoint (freeing its space) and say what a resume will use."""
    shutil.rmtree(tmp, ignore_errors=True)
    prev = next((p for p in _step_dirs(root) if p.name != name and verify(p) is None), None)
    why = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or type(exc).__name__)
    keep = f"the previous checkpoint {prev} is intact and train.resume=auto continues from it" if prev else \
        "there is no earlier checkpoint"
    return CheckpointWriteError(f"could not write checkpoint {root / name} ({why}: {exc}); {keep}; "
                                "free space (or lower train.keep_checkpoints) and relaunch")


def save(output_dir, step: int, write_tensors, record: dict, rng: dict, rank: int = 0, keep: int = 2,
         barrier=lambda: None, rollouts: dict | None = None) -> Path:
    """Write step `step`'s checkpoint (collective): `write_tensors(dir)` writes this rank's part of
    the canonical tensors (and may return a future), every rank its RNG (and its `rollouts`, when
    the method has any), rank 0 `record` as train.json; committed now, or by `flush()` once the
    future completes."""
    flush()
    root = ckpt_root(output_dir)
    name = f"step-{step:08d}"
    final = root / name
    tmp = atomic.staging_path(final)
    sfx = _rank_suffix(rank)
    pending = None
    try:
        if rank == 0:
            atomic.staging(final)
        barrier()
        pending = write_tensors(tmp / CANONICAL)
        torch.save(rng, tmp / f"rng{sfx}.pt")
        if rollouts:
            torch.save(rollouts, tmp / f"rollouts{sfx}.pt")
        if rank == 0:
            (tmp / TRAIN).write_text(json.dumps({**record, "integrity": 1}, indent=1))
    except OSError as exc:
        raise _write_failed(root, name, tmp, exc) from None

    class Commit:
        error: OSError | None = None

        def abort(self, exc: OSError) -> None:  # the async writer failed
            self.error = exc

        def __call__(self):
            if self.error is not None:
                raise _write_failed(root, name, tmp, self.error)
            _commit(root, name, tmp, final, rank, keep, barrier)

    commit = Commit()
    if pending is not None:
        _PENDING.append((pending, commit))
    else:
        commit()
    return final


def _commit(root: Path, name: str, tmp: Path, final: Path, rank: int, keep: int, barrier) -> None:
    barrier()
    if rank == 0:
        try:
            (tmp / FILES).write_text(json.dumps({"files": _inventory(tmp)}, indent=1))
        except OSError as exc:
            raise _write_failed(root, name, tmp, exc) from None
        atomic.publish(tmp, final)  # the checkpoint appears whole or not at all (a re-saved step: replaced whole)
        try:
            atomic.write_text(root / "latest", name)
        except OSError:
            pass  # the pointer stays on the previous (complete) checkpoint: resume uses that one
        _prune(root, keep)
    barrier()


def _prune(root: Path, keep: int) -> None:
    done = _step_dirs(root)[::-1]  # oldest first
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def record(path: Path) -> dict:
    """train.json of a checkpoint (its `integrity` mark left out)."""
    rec = json.loads((Path(path) / TRAIN).read_text())
    rec.pop("integrity", None)
    return rec


def rng(path: Path, rank: int) -> dict | None:
    """The RNG state rank `rank` saved, or None when that rank did not exist then."""
    f = Path(path) / f"rng{_rank_suffix(rank)}.pt"
    return torch.load(f, weights_only=True) if f.is_file() else None


def rng_digest(path: Path, rank: int) -> str | None:
    """sha256 of the RNG state rank `rank` saved (its file's bytes), or None when it has none."""
    f = Path(path) / f"rng{_rank_suffix(rank)}.pt"
    return _sha256(f) if f.is_file() else None


def rollouts(path: Path, rank: int) -> dict | None:
    """The rollouts rank `rank` saved for the steps after this checkpoint, or None."""
    f = Path(path) / f"rollouts{_rank_suffix(rank)}.pt"
    return torch.load(f, weights_only=True) if f.is_file() else None


def is_legacy(path: Path) -> bool:
    """A step directory from before the canonical format."""
    return not (Path(path) / TRAIN).is_file() and (Path(path) / LEGACY).is_file()


def legacy_layout(path: Path) -> dict:
    """What wrote a step directory from before the canonical format, read from its files: the
    backend (zero/ DeepSpeed, dcp/ FSDP2, model.rank1.safetensors Megatron, else single) and the
    world size (one state.json per rank)."""
    path = Path(path)
    world = 1 + len(list(path.glob("state.rank*.json")))
    backend = ("deepspeed" if (path / "zero").is_dir() else "fsdp2" if (path / "dcp").is_dir()
               else "megatron" if (path / "model.rank1.safetensors").is_file() else "single")
    return {"backend": backend, "world": world}


def legacy_meta(path: Path, rank: int) -> dict:
    """train_state, method and rng of rank `rank` in a step directory from before the canonical format."""
    sfx = _rank_suffix(rank)
    meta = json.loads((Path(path) / f"state{sfx}.json").read_text())
    meta.pop("integrity", None)
    meta["rng"] = torch.load(Path(path) / f"rng{sfx}.pt", weights_only=True)
    return meta
