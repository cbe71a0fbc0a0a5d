"""The checkpoint format every layout reads: trainable tensors and their optimizer state under one
canonical (Hugging Face) naming, written with torch.distributed.checkpoint (DCP).

    flat = canonical.torch_state(module, optimizer, trainable)   # single/DDP and FSDP2 (DTensor shards)
    future = canonical.write(step_dir / "canonical", flat)       # collective; every rank writes its part
    canonical.torch_load(module, optimizer, trainable, canonical.reader(step_dir / "canonical"))
    tensors = canonical.read_all(step_dir / "canonical")         # everything, whole, one process

Keys (one flat dict of tensors, nothing else, so reading unpickles nothing):
    model/<name>                  a trainable tensor (full fine-tuning: every parameter but a tied
                                  lm_head; adapters: the adapter tensors only)
    optim/<name>/<state>          its optimizer state (AdamW: exp_avg, exp_avg_sq, step), same shape
<name> is the Hugging Face state-dict key of the base model (`model.layers.0.mlp.up_proj.weight`)
or, under adapters, the key PEFT writes in adapter_model.safetensors (`base_model.model.model.
layers.0.self_attn.q_proj.lora_A.weight`), so `model/*` of a LoRA checkpoint is an adapter as it
stands. `canonical_name` maps the workbench's module names to it (three string rules); Megatron's
fused, sharded names go through its bridge (workbench/megatron/bridge.py).

Storage: DCP's HuggingFaceStorageWriter, one safetensors file per writing rank with each chunk's
offsets in its header, no pickled metadata. DCP does the resharding: a reader asks for the keys
it needs in its own shapes (plain tensors, or DTensor shards under FSDP2 / Megatron TP) and DCP
reads the overlapping chunks whatever layout wrote them. Each backend writes only what it owns
(DDP replicas are deduplicated, DeepSpeed and pipeline stages write different keys per rank).
Hyperparameters (lr, betas, eps, weight decay) and the schedule's shape always come from the
config, never the checkpoint; where the schedule stands (`schedule_state`) is JSON in train.json
(workbench/checkpoints/checkpoint.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.core.errors import UserError

FORMAT = "workbench-canonical/1"
Reader = Callable[[dict], None]


def canonical_name(fqn: str, adapter: str = "default") -> str:
    """The Hugging Face / PEFT name of a workbench parameter name (SelectiveLM's, DeepSpeed's
    engine module's, FSDP2's): the wrapper's `inner.` goes, the adapter name goes
    (`lora_A.default.weight` -> `lora_A.weight`), and DoRA's magnitude loses `.weight`, as PEFT
    saves them."""
    k = fqn.removeprefix("inner.")
    k = k.replace(f".{adapter}.", ".")
    return k.removesuffix(".weight") if k.endswith(".lora_magnitude_vector.weight") else k


def flatten(model: dict, optim: dict) -> dict:
    """{canonical name: tensor}, {canonical name: {state key: tensor or number}} -> the flat dict."""
    flat = {f"model/{n}": t for n, t in model.items()}
    for n, state in optim.items():
        for key, t in state.items():
            if t is None:  # SGD without momentum keeps momentum_buffer=None: nothing to carry
                continue
            flat[f"optim/{n}/{key}"] = t if torch.is_tensor(t) else torch.tensor(float(t))
    return flat


def unflatten(flat: dict) -> tuple[dict, dict]:
    """The flat dict -> ({canonical name: tensor}, {canonical name: {state key: tensor}})."""
    model, optim = {}, {}
    for key, t in flat.items():
        kind, rest = key.split("/", 1)
        if kind == "model":
            model[rest] = t
        else:
            name, what = rest.rsplit("/", 1)
            optim.setdefault(name, {})[what] = t
    return model, optim


# -- storage ------------------------------------------------------------------------------------
def write(path: Path, flat: dict, process_group=None, async_save: bool = False):
    """Write this rank's part of `flat` into the directory `path` (collective when a process group
    is up). Returns DCP's future with `async_save` (tensors are staged to host memory first), else
    None. A write that fails raises the OSError behind it (disk full), whichever rank it hit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.api import CheckpointException

    Path(path).mkdir(parents=True, exist_ok=True)
    group = dist.is_initialized()
    writer = HuggingFaceStorageWriter(str(path), save_distributed=group)
    kw = dict(storage_writer=writer, process_group=process_group, no_dist=not group)
    try:
        with _quiet():
            if async_save:
                return dcp.async_save(flat, **kw)
            dcp.save(flat, **kw)
    except CheckpointException as exc:
        raise _os_error(exc) from None
    return None


def _os_error(exc) -> BaseException:
    """The OSError (ENOSPC, EACCES) inside DCP's per-rank failure report, else the report."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        while inner is not None and not isinstance(inner, OSError):
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            return inner
    return exc


def describe(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (full shape, dtype)} of a canonical directory, from its files' headers."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items()}


def read_all(path: Path) -> dict:
    """Every tensor of a canonical directory, whole, in one process (tools and tests)."""
    want = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in describe(path).items()}
    reader(path)(want)
    return want


def reader(path: Path, where: str = "") -> Reader:
    """`read(want)`: fill the tensors of `want` (plain, or DTensor shards) in place from `path`,
    after checking that the checkpoint has every key at the same full shape; a missing key or
    another shape is one UserError naming the first few (another model, adapter or optimizer)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    held = describe(path)
    label = where or str(path)

    def read(want: dict) -> None:
        missing = sorted(k for k in want if k not in held)
        if missing:
            have = sorted(held)
            raise UserError(f"{label}: the checkpoint lacks {len(missing)} tensor(s) this run needs, e.g. "
                            f"{missing[:2]} (it holds {len(have)}, e.g. {have[:2]}); resume with the model, peft "
                            "and optim settings that wrote it, or start a new output_dir")
        # a DTensor's shape is its global shape
        shapes = [(k, tuple(t.shape), held[k][0]) for k, t in want.items() if tuple(t.shape) != held[k][0]]
        if shapes:
            k, mine, theirs = shapes[0]
            raise UserError(f"{label}: {k} has shape {theirs} in the checkpoint, {mine} in this run "
                            f"({len(shapes)} such); resume with the model and peft settings that wrote it")
        with _quiet():
            dcp.load(want, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())

    return read


@contextmanager
def _quiet():
    """DCP warns on every call without a process group that it assumes one process: that is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- schedule -----------------------------------------------------------------------------------
def schedule_state(scheduler, scaler=None) -> dict:
    """The LR schedule and loss scaler as JSON. The scheduler's own count (`last_epoch`) is kept
    apart from the step: a skipped NaN step does not advance it."""
    s = scheduler.state_dict()
    out = {"last_epoch": int(s["last_epoch"]), "_step_count": int(s.get("_step_count", 0)),
           "base_lrs": [float(x) for x in s["base_lrs"]], "_last_lr": [float(x) for x in s.get("_last_lr", [])]}
    if scaler is not None:
        out["scaler"] = {k: (float(v) if isinstance(v, float) else v) for k, v in scaler.state_dict().items()}
    return out


def apply_schedule(scheduler, optimizer, state: dict, scaler=None) -> None:
    """Restore `schedule_state`: where the schedule stands (its count), not what it computed. The
    base LR and the schedule's shape are this run's config (optim.lr, optim.scheduler over
    train.max_steps), so a resume that changes them (train.resume_changes=allow) applies the new
    values from its first step; the checkpoint's base_lrs and last LR would otherwise carry the old
    ones on. LambdaLR.load_state_dict does not set the param groups' lr, so it is set here (the
    first optimizer step after resuming uses it)."""
    s = scheduler.state_dict()
    s.update({k: v for k, v in state.items() if k in ("last_epoch", "_step_count")})
    scheduler.load_state_dict(s)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is not None:  # LambdaLR (workbench/compute/optim.py): this config's factor at the restored count
        last = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, lambdas, strict=True)]
        scheduler._last_lr = last
    else:
        last = scheduler.get_last_lr()
    for group, lr in zip(optimizer.param_groups, last):
        group["lr"] = lr
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])


# -- single / DDP and FSDP2 ---------------------------------------------------------------------
def torch_state(module, optimizer, trainable: list[str]) -> dict:
    """The canonical flat dict of a torch module and optimizer through get_state_dict: plain
    tensors on one process or under DDP (DCP writes a replicated key once), DTensor shards
    under FSDP2 (each rank writes its shard). A fresh optimizer gets its (zero) state here."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(module, optimizer)
    keep = set(trainable)  # a tied lm_head is in the state dict but not a parameter of its own
    model = {canonical_name(k): v for k, v in msd.items() if k in keep}
    optim = {canonical_name(k): st for k, st in osd["state"].items() if k in keep}
    return flatten(model, optim)


def torch_load(module, optimizer, trainable: list[str], read: Reader) -> None:
    """Fill `module` and `optimizer` from a canonical checkpoint at this layout's shapes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    flat = torch_state(module, optimizer, trainable)
    read(flat)
    back = {canonical_name(k): k for k in trainable}
    model, optim = unflatten(flat)
    _, osd = get_state_dict(module, optimizer)
    # strict=False: the frozen base (adapters) and a tied lm_head are not in the checkpoint
    set_state_dict(module, optimizer, model_state_dict={back[n]: t for n, t in model.items()},
                   optim_state_dict={"state": {back[n]: st for n, st in optim.items()},
                                     "param_groups": osd["param_groups"]},
                   options=StateDictOptions(strict=False))
