"""`dry_run=trace`: the resolved run's training step executed at its real shape on fake tensors,
as rank 0 of a fake process group of the run's world size (and as the last rank, a pipeline's
last stage, where the stages differ), and its per-device peak held beside the plan's.

    python -m workbench method=dpo model=70b hardware=8xh100 backend=fsdp2 train.micro_batch_size=1 dry_run=trace
    python -m workbench model=tiny backend=fsdp2 hardware.procs=2 dry_run=trace plan.json=true

What runs is the code a real run runs: the model built by workbench/models/build.py from the
catalog's architecture numbers (or model.path's config; no weights, nothing downloaded) with the
run's load dtype, peft's adapters and the precision policy's casts; SelectiveLM around it (the
run's loss_chunk); the backend's own `wrap` (FSDP2: fully_shard per block with its
MixedPrecisionPolicy, over a device mesh of the fake group); the method's own `attach` (DPO's
reference) and `loss`; the backend's `forward_backward` (accumulation, no gradient sync before
the last micro-batch) and `optimizer_step` (clip, AdamW). Tensors are FakeTensors
(workbench/plan/fake.py): shapes, dtypes and storages, no data, so 70B takes no memory.

What is measured: torch's memory trackers (torch.distributed._tools: FSDPMemTracker under FSDP2,
MemTracker otherwise) count every tensor storage alive on the traced rank, by category, and the
tracer records when the highest total came (phase and module). The optimizer's state exists
before the traced step (a warm-up step on zero gradients), as at every step but the first, and
two micro-batches are traced when the run accumulates (the second finds the first's gradients,
FSDP2's unreduced ones included). On a CUDA profile AdamW runs its foreach kernels, as torch
chooses on a GPU; the trace itself runs on the CPU device, whose attention kernel for rows of
more than 128 tokens (flash) saves what CUDA's does.

What a tensor trace cannot see (the allocator's fragmentation and caching, the CUDA context,
NCCL's buffers, kernel workspaces) is the margin the planner holds back already: usable memory is
HEADROOM of the device's (workbench/plan/fit.py). The verdict is the traced peak against that.

GRPO (engine=hf): the rollout's longest step (every completion running to max_new_tokens: the
shared prefill, the KV cache at its last decode step's length, that step and the sampler), then
the training micro-batches it makes, through the method's own loss
(workbench/methods/grpo_trace.py); the peak is the larger of the two phases.

Megatron: Megatron-Core's own parallel state over the fake group (its gloo side groups fake too,
workbench/plan/fake.py), its DDP and distributed optimizer; a pipeline's first and last stages.

Not traced, said so with the reason (never a number that was not traced): DeepSpeed, DDP
(backend=single over several processes),
QLoRA's NF4 weights, methods that load a teacher, vLLM rollouts, async rollouts, multi-turn
episodes, fp8, liger kernels, torch.compile, unsloth, sequence parallelism, and DPO's
precomputed reference.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

from workbench.backends import registry as backends
from workbench.data.chat import IGNORE
from workbench.data.collate import pad_batch
from workbench.data.preference import Pair
from workbench.methods import registry as methods
from workbench.methods.logps import collate
from workbench.models import load
from workbench.models.auto import meta_model
from workbench.models.build import build_model
from workbench.models.head import SelectiveLM
from workbench.plan.fake import (
    TERM_ORDER,
    TraceMode,
    fake_world,
    global_shapes_apart,
    module_moves,
    peak_terms,
    peak_tracker,
)
from workbench.plan.fit import HEADROOM, GiB
from workbench.train.batch import StepBatch
from workbench.train.context import Context

MARGIN_WHAT = ("allocator fragmentation and caching, the CUDA context, NCCL's buffers and kernel workspaces, "
               "which a tensor trace cannot see")
MARGIN_SOURCE = "workbench/plan/fit.py HEADROOM (the planner's own reserve)"


def why_not(run) -> str | None:
    """The reason this run's step cannot be traced here, or None."""
    cfg = run.cfg
    backend = backends.spec(cfg.backend.name)
    spec = methods.spec(cfg.method.name)
    if backend.facts.untraced:
        return f"backend={backend.name}: {backend.facts.untraced}"
    rollout_why = spec.trace.untraced(cfg.method) if spec.trace else None
    checks = [
        (run.peft.quantised, "peft=qlora: bitsandbytes quantises real weights to NF4 as it builds them; fake "
                             "tensors carry no data to quantise"),
        (spec.facts.teacher, f"method={spec.name} loads a teacher model (not traced)"),
        (spec.facts.generates and spec.trace is None, f"method={spec.name} generates during the step (its KV "
                                                      "cache and sampler are not traced)"),
        (spec.trace is not None and cfg.get("env") is not None,
         f"env={(cfg.get('env') or {}).get('name')}: multi-turn episodes are not traced"),
        (bool(rollout_why), rollout_why),
        (spec.trace is None and spec.facts.data not in ("sft", "preference"),
         f"method={spec.name}: its batch ({spec.facts.data} rows) is not made by the tracer"),
        (spec.facts.scalar_head, f"method={spec.name}'s value head is not traced"),
        (run.reference == "precomputed", "method.reference=precomputed reads its cached log-probs from the data"),
        (bool(run.precision.fp8), "precision=fp8 swaps in torchao/Transformer Engine layers (not traced)"),
        (cfg.kernels != "none", f"kernels={cfg.kernels}: GPU kernels (not traced)"),
        (bool(cfg.train.compile), "train.compile=true: the compiled step is not traced (the eager one would be)"),
        (cfg.model.loader != "hf", f"model.loader={cfg.model.loader} (not traced)"),
        (run.layout.sp > 1, "backend.sp > 1: sequence parallelism is not traced"),
        (bool(backend.facts.untraced_with_experts) and bool(cfg.model.arch.experts),
         f"backend={backend.name} with experts: {backend.facts.untraced_with_experts}"),
        (bool(backend.facts.untraced_generating) and spec.facts.generates,
         f"backend={backend.name} with method={spec.name}: {backend.facts.untraced_generating}"),
        (bool(backend.facts.untraced_over_processes) and run.layout.world > 1,
         f"backend={backend.name} over {run.layout.world} processes: {backend.facts.untraced_over_processes}"),
        (bool(cfg.data.packing), "data.packing=true: packed rows are not made by the tracer"),
    ]
    return next((why for bad, why in checks if bad), None)


def _fake_base(model_cfg, dtype: torch.dtype) -> torch.nn.Module:
    """The HF model the run would load, built from its config alone (inside the fake mode)."""
    from transformers import AutoModelForCausalLM

    config = meta_model(model_cfg).config if getattr(model_cfg, "arch_from", None) \
        else load.hf_config(model_cfg.arch)
    config._attn_implementation = load.attention_for(model_cfg.attn_implementation, "cpu")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = False
    return model


def _row(seq: int, prompt: int, vocab: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    ids = torch.randint(vocab, (seq,), generator=gen).tolist()
    return ids, [IGNORE] * prompt + ids[prompt:]


def make_batch(run, micro_batches: int) -> StepBatch:
    """Micro-batches of the planner's shape (workbench/plan/memory.py tokens_per_micro): every row
    data.seq_len tokens, the last (1 - plan.select_fraction) of them... the first, as a prompt,
    carrying no loss; preference pairs as two rows (chosen, rejected). Real tensors: the tracer
    gives them to the fake mode with their values (TraceMode.known)."""
    cfg = run.cfg
    seq, mb = int(cfg.data.seq_len), int(cfg.train.micro_batch_size)
    prompt = min(seq - 2, int(round(seq * (1.0 - float(cfg.plan.select_fraction)))))
    gen = torch.Generator().manual_seed(0)
    vocab = int(cfg.model.arch.vocab)
    preference = methods.spec(cfg.method.name).facts.data == "preference"
    micro = []
    for _ in range(micro_batches):
        if preference:
            pairs = [Pair(chosen=_row(seq, prompt, vocab, gen), rejected=_row(seq, prompt, vocab, gen), prompt_len=prompt)
                     for _ in range(mb)]
            micro.append(collate(pairs, 0))
        else:
            micro.append(pad_batch([_row(seq, prompt, vocab, gen) for _ in range(mb)], 0))
    denom = float(mb * micro_batches) if preference else float(sum(m["targets"].numel() for m in micro))
    return StepBatch(micro=micro, denom=denom, tokens=sum(int(m["input_ids"].numel()) for m in micro))


def _warm(optimizers, foreach: bool) -> None:
    """One optimizer step on zero gradients: the state (AdamW's moments) exists as it does at
    every step after the first. `foreach`: the multi-tensor kernels torch picks on a GPU."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if foreach:
                group["foreach"] = True
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _short(module: str) -> str:
    """A module path without the wrappers' prefixes: layers.3.self_attn, lm_head, ..."""
    if "." not in module:
        return "the root module, outside the decoder blocks (embeddings, final norm, head and loss)"
    name = module.split(".", 1)[1]
    for wrapper in ("inner.", "base_model.", "model.model.", "model."):
        name = name.removeprefix(wrapper)
    return name


def _step(run, mode: TraceMode | None, window=None) -> dict:
    """Build, wrap and step the run; the tracker's figures. `mode`: the fake tensors of a trace;
    None runs the same on real tensors (tests/unit/test_trace.py), where `window` (a
    workbench/plan/tensor_memory.py Window) measures the allocator around the step as well."""
    cfg = run.cfg
    here = run.on("cpu")  # the trace's device; bytes per tensor are the same on a GPU
    # two micro-batches when the run accumulates (the second finds the first's gradients); under a
    # pipeline as many as it keeps in flight (1F1B: a stage holds up to pp micro-batches' activations)
    n = min(int(cfg.train.grad_accum), max(2, run.layout.pp))
    spec = methods.spec(cfg.method.name)
    # real tensors and lists: made before the fake mode
    rollout = spec.trace.sequences(run, n) if spec.trace else None
    batch = None if rollout else make_batch(run, n)
    fake = mode is not None
    apart = global_shapes_apart() if fake else contextlib.nullcontext()
    with mode if fake else contextlib.nullcontext(), module_moves() if fake else contextlib.nullcontext(), apart:
        torch.manual_seed(int(cfg.train.seed))
        model = build_model(here, base=_fake_base(cfg.model, here.load_dtype)) if fake else build_model(here)
        lm = SelectiveLM(model, chunk=run.loss_chunk)
        ctx = Context(here, None, None, Path(cfg.output_dir))
        backend = backends.spec(cfg.backend.name).build(cfg.backend, ctx)
        backend.wrap(lm, ctx)
        method = spec.build(cfg.method, ctx)
        method.attach(backend)
        if getattr(method, "tree", False) and not rollout:  # pairs as two rows, the planner's layout
            method.tree = False
        held = backend.held()
        _warm(held["optimizers"], foreach=cfg.hardware.device == "cuda")
        # torch's FSDPMemTracker where the wrap made FSDP2 modules, its MemTracker elsewhere
        fsdp = any(isinstance(m, FSDPModule) for m in backend.unwrapped().modules())
        tracker = peak_tracker(backend.unwrapped(), held["optimizers"], fsdp)
        from torch.distributed._tools.mem_tracker import _MemRefType

        ref = getattr(getattr(method, "ref", None), "model", None)
        # a frozen copy (method.reference=copy): weights on this device too; a backend's own
        # gradient buffers: gradients
        for t, kind in [*((p, _MemRefType.PARAM) for p in (ref.parameters() if ref is not None else ())),
                        *((g, _MemRefType.GRAD) for g in held["grads"])]:
            tracker._update_and_maybe_create_winfos(t, kind)  # noqa: SLF001 - no public way
        if not rollout:
            micro = mode.known(batch.micro) if fake else batch.micro
            step = StepBatch(micro=micro, denom=batch.denom, tokens=batch.tokens)
        if window is not None:
            window.start()
        with tracker:
            if rollout:  # the rollout's longest step, then the micro-batches it makes
                prompts, rows = rollout
                tracker.phase = "rollout"
                spec.trace.generate(method, backend, prompts)
                tracker.phase = None
                step = spec.trace.batch(method, backend, rows, known=mode.known if fake else lambda t: t)
            backend.forward_backward(step, method.loss)
            backend.optimizer_step()
        measured = window.stop() if window is not None else None
        peak, terms, cats = peak_terms(tracker)
        return {"peak": peak, "terms": terms, "categories": cats, "where": tracker.where,
                "phases": dict(tracker.phase_peaks),
                "micro_batches": len(step.micro), "measured": measured}


def trace_run(run, plan: dict | None = None) -> dict:
    """The traced figures of `run`'s step (GiB per device), or {"traced": False, "reason": ...}.
    `plan`: make_plan's output, whose usable memory and terms the trace is held against."""
    reason = why_not(run)
    if reason:
        return {"traced": False, "reason": reason}
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return {"traced": False, "reason": "a process group is running in this process already"}
    world = run.layout.world
    t0 = time.perf_counter()
    # the rank kinds that hold different things: a pipeline's first stage (its embeddings, and
    # the most micro-batches in flight) and its last (the head and the loss); elsewhere every
    # rank holds what rank 0 does
    # (the last stage's first rank: Megatron-Core orders ranks tp, cp, ep, dp, pp, so its data-
    # and tensor-parallel ranks are rank 0's, as the resolved layout has them)
    pp = run.layout.pp
    kinds = {0: "the first stage", world - world // pp: "the last stage"} if pp > 1 else {0: ""}
    ranks, stand_ins = {}, 0
    try:
        for rank in kinds:
            mode = TraceMode()
            with fake_world(world, rank):
                ranks[rank] = _step(run, mode)
            stand_ins += mode.stand_ins
    except Exception as exc:  # noqa: BLE001 - a failed trace is reported as such, never as a number
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/workbench/" in f.filename]
        at = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        line = (str(exc).strip().splitlines() or [""])[0][:300]
        return {"traced": False, "reason": f"the trace failed: {type(exc).__name__}: {line}{at}"}
    rank = max(ranks, key=lambda r: ranks[r]["peak"])
    got = ranks[rank]
    out = {"traced": True, "world": world, "rank": rank, "device": "cpu (fake tensors)",
           "ranks": [{"rank": r, "kind": kinds[r], "peak_gb": round(g["peak"] / GiB, 3)} for r, g in ranks.items()],
           "micro_batches": got["micro_batches"], "grad_accum": int(run.cfg.train.grad_accum),
           "seconds": round(time.perf_counter() - t0, 1), "stand_ins": stand_ins,
           "peak_gb": round(got["peak"] / GiB, 3),
           "terms_gb": {k: round(v / GiB, 3) for k, v in got["terms"].items()},
           "categories_gb": {k: round(v / GiB, 3) for k, v in got["categories"].items()},
           "where": {"phase": got["where"][0], "module": _short(got["where"][1]) if got["where"][1] else ""},
           "phases_gb": {k: round(v / GiB, 3) for k, v in got["phases"].items()}}
    if plan is not None:
        here = plan["here"]
        usable = float(here["usable_gb"])
        out.update(usable_gb=usable, memory_gb=float(here["memory_gb"]), fits=out["peak_gb"] <= usable,
                   plan_peak_gb=float(plan["memory_gb"]["peak"]),
                   margin={"gb": round(float(here["memory_gb"]) - usable, 2), "share": round(1 - HEADROOM, 3)
                           if here["device"] != "cpu" else 0.0, "what": MARGIN_WHAT, "source": MARGIN_SOURCE})
        out["plan_vs_trace"] = round(out["plan_peak_gb"] / out["peak_gb"] - 1, 4) if out["peak_gb"] else None
    return out


def plan_terms(plan: dict) -> dict[str, float]:
    """The plan's memory terms (GiB) gathered into the trace's (workbench/plan/fake.py TERMS)."""
    m = plan["memory_gb"]
    return {"weights": m["weights"] + m["reference"], "grads": m["grads"], "optimizer": m["optimizer"] + m["master"],
            "activations": m["activations"] + m["casts"] + m["logits"] + m["generation"],
            "temporaries": m["transient"]}


def lines(trace: dict, plan: dict) -> list[str]:
    """The trace beside the plan, as printed after the plan's tables."""
    if not trace["traced"]:
        return [f"trace: not traced: {trace['reason']}"]
    ours = plan_terms(plan)
    kinds = trace.get("ranks", [])
    each = " and ".join(f"{k['rank']} ({k['kind']}, {k['peak_gb']:.1f} GiB)" for k in kinds)
    who = (f"as ranks {each} of {trace['world']}; the figures below are rank {trace['rank']}'s, the higher"
           if len(kinds) > 1 else
           f"as rank {trace['rank']} of {trace['world']} (backend={plan['backend']}: every rank holds the same)")
    out = [f"trace: the step executed at its real shape on fake tensors {who}, {trace['micro_batches']} of "
           f"train.grad_accum={trace['grad_accum']} micro-batches, {trace['seconds']:.0f} s",
           f"  {'GiB per device':<30}{'plan':>8}{'traced':>9}"]
    named = {"activations": "activations (+casts, logits)", "temporaries": "temporaries (plan: transient)",
             "weights": "weights (+gathered, reference)", "optimizer": "optimizer (+master)"}
    for k in TERM_ORDER:
        out.append(f"  {named.get(k, k):<30}{ours[k]:>8.1f}{trace['terms_gb'][k]:>9.1f}")
    diff = trace.get("plan_vs_trace")
    out.append(f"  {'peak':<30}{trace['plan_peak_gb']:>8.1f}{trace['peak_gb']:>9.1f}"
               + (f"   the plan {abs(diff):.1%} {'above' if diff >= 0 else 'below'} the trace"
                  if diff is not None else ""))
    w = trace["where"]
    out.append(f"  the traced peak comes in the {w['phase'] or 'step'}"
               + (f", in {w['module']}" if w["module"] else "") + " (the plan's terms peak at different moments)")
    phases = trace.get("phases_gb", {})
    if "rollout" in phases:  # the rollout and the training step peak apart; the plan adds its generation term
        train = max(v for k, v in phases.items() if k != "rollout")
        out.append(f"  the rollout's own peak {phases['rollout']:.1f} GiB (its KV cache and sampler at "
                   f"max_new_tokens), the training step's {train:.1f}; the plan's generation term "
                   f"{plan['memory_gb']['generation']:.1f}, counted on top of its training peak")
    m = trace["margin"]
    if m["gb"] > 0:
        out.append(f"  margin: {m['gb']:.1f} GiB of {trace['memory_gb']:.0f} held back for {m['what']} "
                   f"({m['source']})")
    verdict = "fits" if trace["fits"] else "does not fit"
    out.append(f"  traced verdict: {verdict} ({trace['peak_gb']:.1f} GiB per device of {trace['usable_gb']:.1f} usable)"
               + ("" if trace["fits"] == plan["fits"] else
                  f"; the plan said it {'fits' if plan['fits'] else 'does not fit'}"))
    return out


# A plan whose peak comes this close to the usable memory is a verdict the trace should confirm:
# the matrix (docs/measurements/trace-matrix.md) holds the planner within 10% of the trace where
# traced, and the terms it has not met there (other backends, methods, shapes) may be off more.
CLOSE_CALL = 0.15


def close_call(run, plan: dict) -> str | None:
    """The line a dry run prints under a plan that fits within CLOSE_CALL of the usable memory
    (not traced): how to trace it, or why it cannot be. None for a clear verdict either way."""
    here = plan["here"]
    usable, peak = float(here["usable_gb"]), float(here["peak_gb"])
    if not plan["fits"] or usable <= 0 or peak < (1 - CLOSE_CALL) * usable:
        return None
    head = (f"close call: the plan's {peak:.1f} GiB per device is within {CLOSE_CALL:.0%} of the {usable:.1f} usable; "
            "the plan is arithmetic")
    reason = why_not(run)
    if reason:
        return f"{head}, and this run cannot be traced here ({reason})"
    return (f"{head}: add dry_run=trace to run the step itself on fake tensors and check it (about a minute "
            "for 70B on a CPU, nothing downloaded)")


def refusal(trace: dict) -> str:
    """The one line of a dry run whose plan fits and whose traced step does not."""
    return (f"the traced step does not fit: {trace['peak_gb']:.1f} GiB per device at its peak "
            f"({trace['where']['phase']}, {trace['where']['module'] or 'the step'}) but {trace['usable_gb']:.1f} GiB "
            f"usable, while the plan counted {trace['plan_peak_gb']:.1f}; lower train.micro_batch_size or "
            "data.seq_len, or turn on activation checkpointing, and trace again")
