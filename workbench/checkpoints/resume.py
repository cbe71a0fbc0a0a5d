"""Resuming at another layout: what a checkpoint says about itself, whether this run may continue
it, and at what batch arithmetic. Everything here runs before any weights load.

    rec = resume.record_of(cfg.output_dir, cfg.train.resume)   # train.json of the resume point, or None
    cfg = resume.keep_global_batch(cfg, rec, layout, step)     # train.grad_accum so the global batch stays
                                                               # (step: the method's MethodSpec.batch)
    resume.check_identity(rec, resume.identity(cfg, run, tokenizer, contract))   # same model/adapter/tokenizer

The data position is global (every rank draws the whole global batch, workbench/data/mixing.py),
so a run continues at the next unseen sample whatever the world size, provided each step still
takes as many samples: `keep_global_batch` recomputes train.grad_accum for the new data-parallel
size from the global batch the checkpoint recorded, or refuses in one line naming the nearest
layouts that keep it (`train.keep_global_batch=false` accepts a new global batch instead; the
LR schedule continues by optimizer step either way). A checkpoint of another model, adapter
kind or adapter shape, or of another tokenizer or chat template, is refused by `check_identity`.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from workbench.checkpoints import canonical, checkpoint
from workbench.core.errors import UserError


def record_of(output_dir, mode: str) -> dict | None:
    """train.json of the checkpoint a resume would start from, without checking its files (the
    runner verifies them, and falls back only to older checkpoints of the same run): None for a
    fresh run; for a step directory from before the canonical format, what wrote it."""
    if mode == "never":
        return None
    if mode == "auto":
        candidates = checkpoint._candidates(checkpoint.ckpt_root(output_dir))
    else:
        candidates = [Path(mode)]
    for path in candidates:
        try:
            if checkpoint.is_legacy(path):
                return {"format": "legacy", "name": path.name, "layout": checkpoint.legacy_layout(path)}
            return {**checkpoint.record(path), "name": path.name}
        except (OSError, ValueError):
            continue  # unreadable: latest_valid passes it over and says why
    return None


# -- layouts ------------------------------------------------------------------------------------
def layout_of(cfg, run) -> dict:
    """The layout a checkpoint records: backend, how it spreads the model over ranks (from its
    facts, run.backend_facts), ranks, parallel degrees, precision, batch."""
    lay, facts = run.layout, run.backend_facts
    stage = run.backend_terms.stage  # set by a backend with a stage option (DeepSpeed's ZeRO stage)
    spread = "model" if facts.model_parallel else "replicated" if facts.shards_from_stage is None else "sharded"
    return {"backend": cfg.backend.name, "spread": spread, "world": lay.world, "dp": lay.dp, "tp": lay.tp,
            "pp": lay.pp, "stage": int(stage) if stage is not None else None, "precision": run.precision.name,
            "micro": run.batch.micro, "accum": run.batch.accum}


def describe(layout: dict) -> str:
    """fsdp2x2, zero3x2, megatron tp2, single, ddp x2 (the notation of docs/measurements/resume.md's moves table),
    from the record alone: its ZeRO stage, or how its backend spreads the model (`spread`; a
    record without it, from before the field or a legacy directory, is named by backend and size)."""
    b, w, spread = layout.get("backend", "?"), int(layout.get("world", 1)), layout.get("spread")
    if layout.get("stage") is not None:  # recorded by a backend with a stage option: ZeRO
        return f"zero{layout.get('stage')}x{w}"
    if spread == "model":
        parts = [f"tp{layout['tp']}" if layout.get("tp", 1) > 1 else "", f"pp{layout['pp']}" if layout.get("pp", 1) > 1
                 else "", f"dp{layout['dp']}" if layout.get("dp", 1) > 1 else ""]
        return f"{b} " + (" ".join(p for p in parts if p) or "x1")
    if spread == "replicated" or (spread is None and w == 1):  # several processes: DDP replicas
        return b if w == 1 else f"ddp x{w}"
    return f"{b}x{w}"


# -- the global batch ---------------------------------------------------------------------------
def accum_for(size: int, micro: int, world: int, model_parallel: int = 1, group: int = 1) -> int | None:
    """train.grad_accum that keeps a global batch of `size` rows at `world` ranks, or None: the
    data-parallel ranks must split it evenly, each rank's share must be whole micro-batches and
    (GRPO) whole groups of `group` completions."""
    if world % model_parallel:
        return None
    per_rank, rest = divmod(size, world // model_parallel)
    if rest or per_rank % micro or per_rank % group or per_rank == 0:
        return None
    return per_rank // micro


def nearest(size: int, micro: int, world: int, model_parallel: int = 1, group: int = 1,
            search: int = 64) -> list[str]:
    """The nearest layouts that keep the global batch: fewer and more processes at this
    micro-batch, then a smaller micro-batch at this world size."""
    near = []
    below = next((w for w in range(world - 1, 0, -1) if accum_for(size, micro, w, model_parallel, group)), None)
    above = next((w for w in range(world + 1, world + search) if accum_for(size, micro, w, model_parallel, group)),
                 None)
    for w in (below, above):
        if w:
            near.append(f"hardware.procs={w} (train.grad_accum={accum_for(size, micro, w, model_parallel, group)})")
    smaller = next((m for m in range(micro - 1, 0, -1) if accum_for(size, m, world, model_parallel, group)), None)
    if smaller:
        near.append(f"train.micro_batch_size={smaller} (train.grad_accum="
                    f"{accum_for(size, smaller, world, model_parallel, group)})")
    return near


def _shape(step, cfg, micro: int, accum: int, dp: int):
    """The method's step shape (`step`: its MethodSpec.batch) at this batch and layout, or None:
    the method has none, or its options make no step there (its rule says why)."""
    if step is None:
        return None
    try:
        return step(cfg.method, micro, accum, dp)
    except UserError:
        return None


def keep_global_batch(cfg, rec: dict | None, lay, step=None):
    """`cfg` itself, or a read-only copy whose train.grad_accum keeps the checkpoint's global batch
    at this layout (`lay`: the resolved layout); a UserError when no grad_accum can. `step`: the
    method's own step arithmetic, its MethodSpec.batch (GRPO: whole groups per data-parallel
    rank, or method.prompts_per_step groups at any layout), which the resolving caller passes
    (train/ reads no method registry); None: micro-batch x accumulation rows per rank."""
    if rec is None or rec.get("format") != canonical.FORMAT or not cfg.train.keep_global_batch:
        return cfg
    size, micro = int(rec["global_batch"]), int(cfg.train.micro_batch_size)
    w = rec.get("layout", {})
    # the method's step as the checkpoint took it, else as configured here
    shape = (_shape(step, cfg, int(w.get("micro", micro)), int(w.get("accum", cfg.train.grad_accum)),
                    int(w.get("dp", 1)))
             or _shape(step, cfg, micro, int(cfg.train.grad_accum), lay.dp))
    if shape is not None and shape.fixed:
        return cfg  # the global batch is the method's (method.prompts_per_step groups) at any layout
    if micro * int(cfg.train.grad_accum) * lay.dp == size:
        return cfg
    group = shape.group if shape is not None else 1
    micro, accum = split(size, micro, lay.world, lay.model_parallel, group)
    if accum is None:
        near = nearest(size, micro, lay.world, lay.model_parallel, group)
        raise UserError(f"resuming {rec.get('name', 'the checkpoint')} (global batch {size} = {w.get('micro')} x "
                        f"{w.get('accum')} x {w.get('dp')} dp, written by {describe(w)}) at {lay.dp} data-parallel "
                        f"rank(s) with train.micro_batch_size={micro} cannot keep the global batch; use "
                        + " or ".join(near + ["train.keep_global_batch=false"]))
    out = copy.deepcopy(cfg)
    OmegaConf.set_readonly(out, False)
    out.train.micro_batch_size, out.train.grad_accum = micro, accum
    OmegaConf.set_readonly(out, True)
    return out


def split(size: int, micro: int, world: int, model_parallel: int = 1, group: int = 1) -> tuple[int, int | None]:
    """(micro-batch, grad_accum) that keep a global batch of `size` rows at `world` ranks: this
    micro-batch when the ranks can split the batch with it, else the largest smaller one that can
    (3 nodes -> 2 with micro-batch 4: 12 rows = 3 x 2 x 2). The loss is normalised by the global
    batch's tokens (workbench/train/batch.py), so the gradient is the same sum whatever the split,
    and a smaller micro-batch never needs more memory. (micro, None) when no micro-batch can."""
    for m in range(micro, 0, -1):
        accum = accum_for(size, m, world, model_parallel, group)
        if accum is not None:
            return m, accum
    return micro, None


def check_shrink(cfg, lay, step=None) -> None:
    """A multi-node run that may continue on fewer nodes (hardware.min_nodes) must keep its global
    batch at every node count it may shrink to: refused at start, in one line, when some count
    cannot split it with any micro-batch (`split`), rather than after a node is lost. `step`: the
    method's MethodSpec.batch, as for keep_global_batch."""
    hw = cfg.hardware
    lowest = int(hw.min_nodes or hw.nodes)
    if lowest >= int(hw.nodes) or not cfg.train.keep_global_batch:
        return
    micro, accum = int(cfg.train.micro_batch_size), int(cfg.train.grad_accum)
    shape = _shape(step, cfg, micro, accum, lay.dp)
    if shape is not None and shape.fixed:
        return  # the method fixes its global batch at any layout
    size, group = micro * accum * lay.dp, shape.group if shape is not None else 1
    # the node's processes as configured: inside a worker after a node was lost, lay.world is the
    # survivors' count, not nodes x procs
    per_node = int(hw.procs)
    bad = [n for n in range(lowest, int(hw.nodes))
           if split(size, int(cfg.train.micro_batch_size), n * per_node, lay.model_parallel, group)[1] is None]
    if bad:
        ok = [n for n in range(lowest, int(hw.nodes) + 1) if n not in bad]
        # the smallest accumulation at this micro-batch whose global batch every node count splits
        fit = next((a for a in range(accum + 1, accum + 1025)
                    if all(split(micro * a * lay.dp, micro, n * per_node, lay.model_parallel, group)[1] is not None
                           for n in range(lowest, int(hw.nodes)))), None)
        every = f"every node count from {lowest} to {hw.nodes} splits"
        fix = f"train.grad_accum={fit} (global batch {micro * fit * lay.dp}, which {every})" if fit \
            else f"a global batch that {every}"
        raise UserError(f"hardware.min_nodes={lowest}: at {bad[0]} node(s) ({bad[0] * per_node} ranks) no micro-batch "
                        f"splits the global batch of {size} rows evenly, so losing a node there would stop the run; "
                        f"use {fix}, or hardware.min_nodes={min(n for n in ok if n > bad[-1])}")


def plan_line(rec: dict | None, cfg, run) -> str | None:
    """dry_run=true on an existing run directory: where the resume comes from and the batch here."""
    if rec is None:
        return None
    if rec.get("format") == "legacy":
        return (f"resume: {rec['name']} is from before the canonical format, written by "
                f"{describe(rec['layout'])}; it resumes only at that layout")
    b, w = run.batch, rec.get("layout", {})
    kept = "kept" if b.size == rec["global_batch"] else f"changed from {rec['global_batch']} (train.keep_global_batch=false)"
    return (f"resume: {rec['name']} (step {rec['step']}, {rec['samples_seen']} samples, written by {describe(w)}) -> "
            f"{describe(layout_of(cfg, run))}: micro-batch {b.micro} x grad_accum {b.accum} x {b.dp} data-parallel = "
            f"global batch {b.size} ({kept}); fits")


# -- what a checkpoint belongs to ---------------------------------------------------------------
def identity(cfg, run, tokenizer, contract) -> dict:
    """The model, adapter and tokenizer a checkpoint's tensors only make sense with."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    peft = {"kind": run.peft.kind}
    if run.peft.adapter:
        targets = OmegaConf.to_container(cfg.peft.target_modules) if OmegaConf.is_config(cfg.peft.target_modules) \
            else cfg.peft.target_modules
        peft.update(r=int(cfg.peft.r), alpha=int(cfg.peft.alpha), target_modules=targets)
    return {"model": {"name": cfg.model.name, "init_seed": int(cfg.model.init_seed),
                      "arch": OmegaConf.to_container(cfg.model.arch)},
            "peft": peft,
            "tokenizer": {"size": len(tokenizer), "vocab_sha256_16": hashlib.sha256(vocab.encode()).hexdigest()[:16],
                          "chat_template_sha256_16": contract.template_hash, "end_of_turn_id": contract.end_of_turn_id}}


ADAPTERS = {"lora": "a LoRA adapter", "qlora": "a QLoRA adapter (NF4 base)", "dora": "a DoRA adapter",
            "none": "fully fine-tuned weights"}


def check_identity(rec: dict | None, mine: dict) -> None:
    """Refuse, in one line, a checkpoint whose tensors belong to another model, adapter or tokenizer."""
    if rec is None or rec.get("format") != canonical.FORMAT or "identity" not in rec:
        return
    theirs, where = rec["identity"], rec.get("name", "the checkpoint")
    fresh = "or start a new output_dir (or train.resume=never)"
    m0, m1 = theirs["model"], mine["model"]
    if m0 != m1:
        diff = ", ".join(f"{k}={v}" for k, v in m0["arch"].items() if m1["arch"].get(k) != v)
        raise UserError(f"{where} was written for model={m0['name']}" + (f" ({diff})" if diff else "")
                        + f"; this run is model={m1['name']}; resume with model={m0['name']}, {fresh}")
    p0, p1 = theirs["peft"], mine["peft"]
    if p0["kind"] != p1["kind"]:
        if p1["kind"] == "none":
            how = (f"resume with peft={p0['kind']}, or export it (python -m workbench.export <run_dir>) and fine-tune "
                   "export/merged with model.path=")
        else:
            how = f"resume with peft={p0['kind']}, {fresh}"
        raise UserError(f"{where} holds {ADAPTERS.get(p0['kind'], p0['kind'])} (peft={p0['kind']}); this run is "
                        f"peft={p1['kind']}, which cannot continue it: {how}")
    diff = [k for k in p0 if p0.get(k) != p1.get(k)]
    if diff:
        raise UserError(f"{where} holds an adapter with " + ", ".join(f"peft.{k}={p0[k]}" for k in diff)
                        + "; this run's is " + ", ".join(f"peft.{k}={p1.get(k)}" for k in diff)
                        + f": resume with the adapter settings that wrote it, {fresh}")
    t0, t1 = theirs["tokenizer"], mine["tokenizer"]
    if t0 != t1:
        what = ("chat template" if t0["chat_template_sha256_16"] != t1["chat_template_sha256_16"]
                and t0["vocab_sha256_16"] == t1["vocab_sha256_16"] else "tokenizer")
        raise UserError(f"{where} was trained with another {what} ({json.dumps(t0, sort_keys=True)}; this run: "
                        f"{json.dumps(t1, sort_keys=True)}): token ids or the trained format would change under "
                        f"it; resume with the tokenizer and data.chat_template that wrote it, {fresh}")


def check_legacy(rec: dict | None, cfg, world: int) -> None:
    """A step directory from before the canonical format resumes only at the layout that wrote it."""
    if rec is None or rec.get("format") != "legacy":
        return
    theirs = rec["layout"]
    if (theirs["backend"], theirs["world"]) != (cfg.backend.name, world):
        raise UserError(f"{rec['name']} is from before the canonical checkpoint format, written by "
                        f"{describe(theirs)}; resume with that layout once (backend={theirs['backend']} "
                        f"hardware.procs={theirs['world']}) to convert it, then move")
