"""The plan of one run: `make_plan(cfg)` and the one-line refusal of a run that does not fit.

What a method generates per step comes from its spec (MethodSpec.generation: the method's own
options over its Config's defaults); a backend's options (stage, offload, checkpointing) are read
by the names its facts give, with its facts' defaults; precision, peft, the reference and the
layout come from the derived run (workbench/resolve/derive.py). A change
the planner proposes (workbench/plan/fit.py) is applied to the config itself and kept only where
the rule table takes it and the changed run's own plan fits (`_fix_check`).

A dry run whose plan does not fit the configured hardware ends with `DoesNotFit` (exit status 4,
DOES_NOT_FIT_EXIT) after printing the plan; the run itself is refused by preflight (status 2).
"""

from __future__ import annotations

import os
from dataclasses import asdict, replace

import yaml
from omegaconf import OmegaConf

from workbench.backends import registry as backends
from workbench.compute import precision as prec
from workbench.config.files import CONF_DIR
from workbench.config.schema import pick
from workbench.core.errors import UserError
from workbench.methods import registry
from workbench.peft.kind import Peft
from workbench.plan import catalog
from workbench.plan.activations import LORA_TARGETS
from workbench.plan.check import calibration
from workbench.plan.counts import count, probe
from workbench.plan.fit import GiB, usable_bytes, verdict
from workbench.plan.memory import estimate, tokens_per_micro
from workbench.plan.peak import measured_peak_flops
from workbench.plan.setup import Setup
from workbench.plan.speed import Decoder, Rollout, generation_seconds, speed, train_flops_per_token
from workbench.plan.tables import change_here, duration, money, needed_how, show
from workbench.resolve import rules
from workbench.resolve.derive import derive, logits_at_once
from workbench.rollout import judge
from workbench.train.distributed import requested_procs

# The exit status of `dry_run=true` when the plan does not fit the configured hardware (0 done,
# 2 a mistake, 3 a stalled rank, 75 preempted: workbench/cli.py lists them all).
DOES_NOT_FIT_EXIT = 4


class DoesNotFit(UserError):
    """A dry run's plan does not fit the configured hardware: one line (the refusal a real run
    would print), status DOES_NOT_FIT_EXIT, so a script can tell it from a mistake (2)."""

    exit_code = DOES_NOT_FIT_EXIT


# What the preflight line of a dry run says of the weights, by where workbench/models/load.py
# locate() found them ("not found here" is preflight's own: a dry run plans without them).
WEIGHTS_FROM = {
    "tiny": "a random tiny model, built at the start",
    "local": "model.path on this machine",
    "hf_cache": "the HF cache on this machine",
    "converted": "the converted copy in the cache",
    "gguf": "the packaged GGUF, converted once at the start",
    "hub": "the hub, downloaded when the run starts",
    "not found here": "not on this machine (the plan needs none)",
}


def _flag(value) -> bool:
    if isinstance(value, str):
        return value.lower() not in ("", "none", "false", "no", "0")
    return bool(value)


def from_cfg(cfg, devices: int | None = None, completion_len: int | None = None, run=None) -> Setup:
    """What the planner sizes: the backend's options in the planner's terms (BackendSpec.terms:
    its stage, offload, expert parallelism, checkpointing, accumulation sync, optimizer), the
    method's by its spec (MethodSpec.generation: what it generates per step, from its own options
    and defaults), precision, peft, the reference and the layout from the derived run.
    `completion_len`: the mean completion a run measured (the plan check), in place of the
    method's max_new_tokens. `run`: the config's derived run where the caller has it (a plan
    derives each config once)."""
    backend = pick(cfg, "backend.name", "single")
    spec = backends.spec(backend)
    terms = spec.terms(cfg.get("backend"))
    # the backend's own checkpointing option where it turns it on, else the model's switch
    ckpt = terms.checkpointing or ("full" if cfg.model.gradient_checkpointing else "none")
    run = run or derive(cfg)  # precision, peft, the reference strategy and the layout, as the run will have them
    method = registry.spec(cfg.method.name)
    gen = method.generation(cfg.method)  # None: the method trains on its data's rows
    ref = {"precomputed": "precompute"}.get(run.reference, run.reference)
    lay = run.layout if devices is None else replace(run.layout, world=devices)
    return Setup(
        method=method.name, peft=run.peft.kind, lora_r=int(cfg.peft.r), double_quant=bool(cfg.peft.double_quant),
        precision=run.precision.name, optimizer=cfg.optim.name, backend=backend,
        stage=spec.facts.default_stage if terms.stage is None else terms.stage,
        offload_optimizer=terms.offload_optimizer, offload_params=terms.offload_params,
        devices=lay.world, device=cfg.hardware.device,
        tp=lay.tp, pp=lay.pp, cp=lay.cp, ep=terms.ep, sp=lay.sp, tp_splits_tokens=terms.tp_splits_tokens,
        micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum, seq_len=cfg.data.seq_len,
        checkpointing=ckpt, checkpoint_every=terms.checkpoint_every, accum_sync=terms.accum_sync,
        select_fraction=float(pick(cfg, "plan.select_fraction", 1.0)),
        loss_chunk=run.loss_chunk,
        packed=_flag(pick(cfg, "data.packing", False)),  # the methods that read data.packing pack their rows
        dpo_ref=ref, teacher_scale=float(pick(cfg, "plan.teacher_scale", 1.0)),
        **(_rollout_fields(gen, cfg, lay.dp, completion_len) if gen else {}),
        distributed_optimizer=terms.distributed_optimizer,
        hf_copy=spec.facts.bridges_hf_model and run.keeps_hf_base,
    )


def _rollout_fields(gen, cfg, data_parallel: int, completion_len: int | None) -> dict:
    """Setup's rollout fields from what the method generates per step (MethodSpec.generation)."""
    if not gen.groups:  # a completion per micro-batch row (on-policy distillation)
        return dict(generations=gen.generations, completion_len=completion_len or gen.completion_len)
    return dict(rollouts=True, generations=gen.generations, completion_len=completion_len or gen.completion_len,
                rollout_prompts=gen.prompts_per_rank(cfg.train.micro_batch_size, cfg.train.grad_accum, data_parallel),
                num_iterations=gen.num_iterations, share_prompt=gen.share_prompt, old_logps=gen.old_logps,
                vllm_fraction=gen.vllm_fraction, rollout_overlaps=gen.overlaps)


def run_tokens(cfg, s) -> float:
    """Tokens the run trains on: plan.tokens, else max_steps x global batch x sequence."""
    explicit = float(pick(cfg, "plan.tokens", 0) or 0)
    if explicit > 0:
        return explicit
    return float(cfg.train.max_steps * cfg.train.grad_accum * s.data_parallel * tokens_per_micro(s))


def tokens_from(cfg, s) -> dict:
    """The factors of run_tokens, for the plan to show beside the count: the global batch is
    micro-batches per rank x data-parallel ranks, so the count follows the devices."""
    return {"plan_tokens": float(pick(cfg, "plan.tokens", 0) or 0) > 0, "steps": int(cfg.train.max_steps),
            "grad_accum": int(cfg.train.grad_accum), "data_parallel": s.data_parallel,
            "tokens_per_micro": tokens_per_micro(s)}


def with_change(cfg, change: str):
    """The config with a change's overrides applied as the command line would apply them: a
    backend choice replaces the backend's options (its conf/backend/<name>.yaml over its options
    dataclass), another group's choice (peft=lora) is its file over the options already set, and
    key=value sets one key. Not validated again: the overrides are the planner's own."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    for item in change.split():
        key, value = item.split("=", 1)
        group = CONF_DIR / key
        if group.is_dir():
            node = OmegaConf.to_container(OmegaConf.load(group / f"{value}.yaml"))
            node.pop("defaults", None)
            if key == "backend":
                raw[key] = OmegaConf.to_container(OmegaConf.merge(OmegaConf.structured(backends.spec(value).config),
                                                                  node))
            else:
                raw[key] = {**raw[key], **node}
        else:
            *path, leaf = key.split(".")
            where = raw
            for part in path:
                where = where[part]
            where[leaf] = yaml.safe_load(value)
    return OmegaConf.create(raw)


def _fix_check(cfg, counts, devices: int, memory_gb: float, device: str, seen: dict, completion_len: int | None):
    """fit.verdict's `accept` on this config: a change is kept only where the changed config
    breaks no rule of the table the config did not break already (this machine's rules aside:
    the plan is for the profile's) and its own plan fits `memory_gb` per device. `seen`: the
    changed configs by change, shared by the rows of one plan (None: a rule refuses it)."""
    env = rules.Env()

    def changed_cfg(change: str):
        if change not in seen:
            if "" not in seen:  # the rules the config breaks already (a test's hand-made config)
                seen[""] = {r.id for r, _ in rules.violations(cfg, env)}
            changed = with_change(cfg, change)
            broken = any(not r.machine and r.id not in seen[""] for r, _ in rules.violations(changed, env))
            seen[change] = None if broken else changed
        return seen[change]

    def accept(change: str) -> bool:
        changed = changed_cfg(change)
        if changed is None:
            return False
        c = counts
        if changed.peft != cfg.peft:  # adapters of another kind: their own count
            if "probe" not in seen:
                seen["probe"] = probe(cfg.model)
            c = count(seen["probe"], changed.model.arch, changed.peft)
        if ("run", change) not in seen:  # each changed config is derived once, for every row
            seen[("run", change)] = derive(changed)
        e = estimate(c, changed.model.arch, from_cfg(changed, devices=devices, completion_len=completion_len,
                                                     run=seen[("run", change)]))
        return e.peak <= usable_bytes(memory_gb, device, e.vllm_fraction)

    return accept


def _peak_tflops(hw, precision: str) -> float:
    """The datasheet figure of the profile; for this machine's CPU (no datasheet) the matmul rate
    measured here, the peak a run's MFU is taken against (workbench/plan/peak.py)."""
    tflops = catalog.peak_tflops(hw, precision)
    if not tflops and hw.device == "cpu":
        tflops = measured_peak_flops("cpu", prec.spec(precision)) / 1e12
    return tflops


# How this machine's CPU decodes (generation_seconds). Measured with HF generate of SmolLM2-135M,
# bf16 weights under bf16 autocast, one thread, as the best of 3 timings of 10 new tokens less 2
# per decode step: 35 ms for 1 row and 154 ms for 32 rows of the bare model, 66 and 169 ms with
# LoRA r=16 on its 7 linears per block; a streaming read (sum) of a 135M-weight bf16 tensor ran at
# 25-29 GB/s. One row is bound by the weights' read (~10 ms) plus a fixed cost per step of 0.85 ms
# per decoder block and 0.15 ms more per adapter in it (Python modules, operator dispatch); 32
# rows by their FLOPs, at 0.155-0.18 of the measured matmul peak (small matrices). A whole call
# of 2 new tokens took 242 ms for 1 row and 542 ms for 32 (4 prompts x 8, LoRA): less its two
# decode steps and its prefill at training's rate, about 80 ms is the call's own setup.
CPU_BANDWIDTH = 27e9  # bytes/s
CPU_CALL_S = 0.08
CPU_BLOCK_S = 0.85e-3
CPU_ADAPTER_S = 0.15e-3
CPU_DECODE_SHARE = 0.16  # of the CPU's measured matmul peak
# A GPU decode step in eager PyTorch is bound by its kernel launches when the weights are small:
# about a dozen per decoder block at a few microseconds each; with many rows by FLOPs at plan.mfu.
GPU_BLOCK_S = 5e-5
GPU_BANDWIDTH_SHARE = 0.8  # of the datasheet bandwidth a weight-streaming kernel reaches


def decoder(hw, arch, peak_flops: float, mfu: float, peft: str = "none") -> Decoder:
    """How `hw` decodes (workbench/plan/speed.py generation_seconds), its matmul peak `peak_flops`."""
    if hw.device == "cpu":
        block = CPU_BLOCK_S + (LORA_TARGETS * CPU_ADAPTER_S if Peft(peft).adapter else 0.0)
        return Decoder(peak_flops * CPU_DECODE_SHARE, CPU_BANDWIDTH, block * arch.layers, peak_flops * mfu, CPU_CALL_S)
    return Decoder(peak_flops * mfu, catalog.bandwidth_tbs(hw) * 1e12 * GPU_BANDWIDTH_SHARE, GPU_BLOCK_S * arch.layers,
                   peak_flops * mfu)


def rollout_of(s: Setup) -> Rollout:
    """What one rank generates per optimizer step as configured: a prefill of each prompt
    (data.seq_len tokens at most) and max_new_tokens decode steps of all its completions, once
    every num_iterations steps. Dynamic sampling's refills come on top (the plan check measures
    them)."""
    per = 1.0 / s.num_iterations
    return Rollout(prefill_tokens=s.rollout_prompts * s.seq_len * per, decode_steps=s.completion_len * per,
                   rows=s.rollout_prompts * s.generations, calls=per)


def _row(cfg, run, counts, name, hw, mfu, devices: int | None = None, calibrated: bool = False,
         rollout: Rollout | None = None, seen: dict | None = None, completion_len: int | None = None) -> dict:
    """The verdict on hardware profile `hw`: with the processes it asks for, or `devices`;
    `calibrated`: with the measured/predicted ratios an earlier run stored for it; `rollout`:
    what a rank generated per step (the plan check's measurement), else what the config asks;
    `seen`: the changes checked already for another row (_fix_check); `completion_len`: the
    measured mean completion (from_cfg). Tokens/s, time and cost
    are the whole job's on all `devices`: the changed run's where a change makes it fit there,
    None where none does; `needed` gives them on the devices it needs where it does not fit."""
    devices = devices or requested_procs(hw)
    s = from_cfg(cfg, devices=devices, completion_len=completion_len, run=run)
    mem = catalog.memory_gb(hw)
    if hw.device == "cpu":
        mem /= devices  # CPU processes share the host's memory
    arch = cfg.model.arch
    v = verdict(counts, arch, s, mem, hw.device, node_size=hw.procs,
                accept=_fix_check(cfg, counts, devices, mem, hw.device, {} if seen is None else seen,
                                   completion_len))
    # the job as configured, whatever the profile's device count
    tokens = run_tokens(cfg, from_cfg(cfg, completion_len=completion_len, run=run))
    peak = _peak_tflops(hw, s.precision)

    def rates(t) -> tuple[float, float]:
        """FLOPs per trained token of Setup `t`, and its generation's seconds per trained token."""
        trainable = counts.lora if t.adapter else counts.total
        fpt = train_flops_per_token(counts.active, trainable, t.peft, t.method, t.dpo_ref, generation=not t.rollouts,
                                    old_logps=t.old_logps)
        extra = 0.0
        if t.rollouts and peak > 0:  # a decode step reads the weights this device holds
            gen = generation_seconds(rollout or rollout_of(t), counts.active, estimate(counts, arch, t).weights,
                                     decoder(hw, arch, peak * 1e12, mfu, t.peft))
            # per trained token of this rank (under backend.sp every sp rank generates the whole rollout)
            extra = gen * t.sp / (t.grad_accum * tokens_per_micro(t))
        return fpt, extra

    fpt, extra = rates(s)
    ratios = None
    if calibrated:  # measured/predicted of an earlier run on this hardware (plan.calibrate=true)
        ratios = calibration(hw, s.precision, cfg.model.name)
    price = list(hw.price_per_hour) or None
    rate = ratios.get("tokens_per_s", 1.0) if ratios else 1.0

    def whole_job(n: int, fpt: float = fpt, extra: float = extra):
        sp = speed(tokens, fpt, n, peak, mfu, price, extra)
        if sp and rate != 1.0:
            sp = speed(tokens, fpt / rate, n, peak, mfu, price, extra / rate)
        return sp

    # where a change makes it fit on these devices, the speed is the changed run's
    sp = whole_job(devices, *rates(v.fixed)) if not v.fits and v.fixed is not None else whole_job(devices)
    row = {
        "hardware": name, "device": hw.device, "accelerator": hw.accelerator, "devices": devices, "memory_gb": mem,
        "peak_gb": round(v.peak_gb, 2), "usable_gb": round(v.usable_gb, 2), "fits": v.fits,
        "fix": v.fix, "fix_peak_gb": round(v.fix_peak_gb, 2) if v.fix_peak_gb else None,
        "devices_needed": v.devices_needed, "needed_backend": v.needed_backend,
        "tokens_per_s": sp.tokens_per_s if sp else None, "hours": sp.hours if sp else None,
        "cost_usd": list(sp.cost) if sp and sp.cost else None,
        "price_per_hour": list(hw.price_per_hour), "price_date": hw.price_date,
        "flops_per_token": fpt, "generation_s_per_token": extra,
    }
    if ratios:
        v_peak = v.peak_gb * ratios.get("peak_gib", 1.0)
        row.update(peak_gb=round(v_peak, 2), fits=v_peak <= v.usable_gb,
                   calibrated={"from": ratios.get("run"), "time": ratios.get("time"),
                               "peak_gib": ratios.get("peak_gib"), "tokens_per_s": ratios.get("tokens_per_s")})
    if not row["fits"]:
        if v.devices_needed:  # with checkpointing and sharding, on whole nodes of this profile
            need = whole_job(v.devices_needed)
            row["needed"] = {"devices": v.devices_needed, "backend": v.needed_backend,
                             "tokens_per_s": need.tokens_per_s if need else None,
                             "hours": need.hours if need else None,
                             "cost_usd": list(need.cost) if need and need.cost else None}
        if not v.fix:  # no change fits on these devices: no speed on them
            row.update(tokens_per_s=None, hours=None, cost_usd=None)
    return row


def cores(cfg, run) -> dict | None:
    """On a CPU: this machine's cores and the processes the run (its derived run) asks for, when
    it asks for more."""
    have = os.cpu_count() or 1
    asked = run.layout.world
    if cfg.hardware.device != "cpu" or asked <= have:
        return None
    return {"available": have, "asked": asked}


def make_plan(cfg, counts=None, hardware: list[str] | None = None, others: bool = True,
              calibrated: bool = True, rollout: Rollout | None = None, completion_len: int | None = None) -> dict:
    """The plan as plain data (JSON-ready). `counts` may come from preflight's meta probe.
    others=False leaves out the rest of the catalog (a run that fits where it is needs only `here`);
    calibrated=False: the planner's own figures for this hardware, without an earlier run's ratios;
    rollout, completion_len: what a rank generated per step and its mean completion (the plan
    check's measurements). `compare`
    (plan.compare) says whether the table lists the other profiles beside this hardware."""
    counts = counts or count(probe(cfg.model), cfg.model.arch, cfg.peft)
    mfu = float(pick(cfg, "plan.mfu", 0.4))
    run = derive(cfg)  # once: every row and note reads it; each changed config is derived once too
    s = from_cfg(cfg, completion_len=completion_len, run=run)
    est = estimate(counts, cfg.model.arch, s)
    seen = {}  # the changes the rule table was asked about, and their derived runs, for every row
    here = _row(cfg, run, counts, cfg.hardware.name, cfg.hardware, mfu, devices=run.layout.world,
                calibrated=calibrated, rollout=rollout, seen=seen, completion_len=completion_len)
    over = cores(cfg, run)
    if over:  # would it fit with one process per core?
        fit = _row(cfg, run, counts, cfg.hardware.name, cfg.hardware, mfu, devices=over["available"], seen=seen,
                   completion_len=completion_len)
        here["cores"] = {**over, "fits": fit["fits"], "peak_gb": fit["peak_gb"], "usable_gb": fit["usable_gb"]}
    wanted = hardware or list(pick(cfg, "plan.hardware", []) or [])
    rows = [_row(cfg, run, counts, name, hw, mfu, seen=seen, completion_len=completion_len)
            for name, hw in catalog.profiles().items()
            if (not wanted or name in wanted) and name != cfg.hardware.name] if others else []
    plan = {
        "model": cfg.model.name, "method": s.method, "peft": s.peft, "backend": s.backend,
        "precision": s.precision,
        "params": {"total": counts.total, "active": counts.active,
                   "trainable": counts.lora if s.adapter else counts.total},
        "tokens": run_tokens(cfg, s), "tokens_from": tokens_from(cfg, s), "mfu": mfu,
        "setup": asdict(s),
        "memory_gb": {k: round(v / GiB, 3) for k, v in est.terms().items()} | {"peak": round(est.peak / GiB, 3),
                                                                              "host": round(est.host / GiB, 3)},
        "hf_copy_gb": round(est.hf_copy / GiB, 3),  # of memory_gb.weights
        "notes": _notes(cfg, s, est, run),
        "compare": _flag(pick(cfg, "plan.compare", False)),
        "here": here,
        "profiles": rows,
        "fits": here["fits"],  # the verdict on the configured hardware (a dry run's exit status)
    }
    if not plan["fits"]:  # what to change, and where else it fits
        plan["refusal"] = refusal(plan).removesuffix(SEE_PLAN)
    return plan


SEE_PLAN = " See the plan: add dry_run=true"  # the end of a real run's refusal, not a dry run's


def _notes(cfg, s, est, run) -> list[str]:
    """What a memory term holds that its name does not say. Megatron's weights can be two
    models: its GPTModel shards and the whole HF model the runner keeps beside them on every
    device (run.keeps_hf_base, workbench/resolve/derive.py) when something reads that model."""
    notes = []
    if run.loss_chunk and not cfg.model.loss_chunk:  # chosen by the run (Run.loss_chunk), not the user
        notes.append(f"logits = model.loss_chunk={run.loss_chunk} positions at a time, chosen because one micro-batch's "
                     f"{cfg.model.arch.vocab:,}-token logits at once would take {logits_at_once(cfg) / GiB:.1f} GiB; "
                     "set model.loss_chunk to choose another size")
    notes += _judge_notes(cfg, s)
    if not est.hf_copy:
        return notes
    why = [w for w, yes in (("generation decodes with it", run.facts.generates),
                            ("a full fine-tune exports the weights bridged back into it", not run.peft.adapter),
                            (f"reference={run.reference} is made from it", run.reference in ("copy", "precomputed")))
           if yes]
    own = (est.weights - est.hf_copy) / GiB
    return notes + [f"weights = {own:.1f} GiB of backend={s.backend}'s model (tp={s.tp} x pp={s.pp} shards) and adapters "
            f"+ {est.hf_copy / GiB:.1f} GiB for the whole HF model, kept on every device because "
            f"{' and '.join(why) or 'the run reads it between steps'}; no backend.tp/pp splits that copy"]


def _judge_notes(cfg, s) -> list[str]:
    """reward=judge: the calls, tokens and (with reward.seconds_per_call) seconds a step asks of the
    judge's server, which the memory and speed tables above do not hold."""
    spec = pick(cfg, "reward", None)
    functions = (spec.get("functions") if hasattr(spec, "get") else None) or []
    if not s.rollouts or not any((f.get("name") if hasattr(f, "get") else f) == "judge" for f in functions):
        return []
    per_call = spec.get("seconds_per_call")
    return [judge.plan_line(spec, s.rollout_prompts * s.generations * s.dp, None if per_call is None else float(per_call),
                            int(cfg.train.max_steps))]


def refusal(plan: dict) -> str:
    """One line for a run that does not fit where it was asked to run, ending with what to change."""
    h = plan["here"]
    over = h.get("cores")
    if over:  # more CPU processes than cores: that is what to change first
        n = over["available"]
        msg = (f"hardware.procs asks for {over['asked']} processes but this machine has {n} CPU cores "
               f"(os.cpu_count()); set hardware.procs<={n}")
        if over["fits"]:
            msg += f": with {n} the run fits ({over['peak_gb']:.1f} GiB per process of {over['usable_gb']:.1f} usable)"
        else:
            msg += (f"; even with {n} it needs {over['peak_gb']:.1f} GiB per process but has "
                    f"{over['usable_gb']:.1f} GiB usable" + (f" (smallest change that fits here: {h['fix']})"
                                                            if h["fix"] else ""))
        return msg + "." + SEE_PLAN
    runnable = [r for r in plan["profiles"] if r["device"] in ("cuda", "cpu")] or plan["profiles"]
    fits = [r for r in runnable if r["fits"]]
    best = min(fits, key=lambda r: (r["cost_usd"] or [1e18])[0]) if fits else None
    needs_line = (f"model={plan['model']} method={plan['method']} peft={plan['peft']} backend={plan['backend']} "
                  f"needs {h['peak_gb']:.1f} GiB per device but hardware={h['hardware']} has {h['usable_gb']:.1f} "
                  "GiB usable")
    elsewhere = None
    if best:
        cost = best["cost_usd"]
        elsewhere = (f"it fits on hardware={best['hardware']} ({best['devices']} x {best['accelerator']}, "
                     f"{best['peak_gb']:.1f} GiB/device" + (f", ~{duration(best['hours'])}, {money(cost)}"
                                                            if cost else "") + ")")
    else:
        needs = [r for r in runnable if r.get("needed")]
        if needs:
            r = min(needs, key=lambda r: (r["needed"]["cost_usd"] or [1e18])[0])
            need = r["needed"]
            elsewhere = (f"it fits on {need['devices']} x {r['accelerator']} with {needed_how(need)} "
                         f"(hardware={r['hardware']}" + (f", ~{duration(need['hours'])}, {money(need['cost_usd'])}"
                                                         if need["cost_usd"] else "") + ")")
    # what to do comes last: the change here, or where it fits when nothing does here
    here = change_here(h)
    parts = [needs_line, elsewhere, here] if h["fix"] or h.get("needed") else [needs_line, here, elsewhere]
    return "; ".join(p for p in parts if p) + "." + SEE_PLAN


def does_not_fit(plan: dict) -> DoesNotFit:
    """A dry run's end when its plan does not fit: one line, ending with what to change."""
    h = plan["here"]
    if h.get("cores") or not (h["fix"] or h.get("needed")):  # the refusal says what to do instead
        return DoesNotFit(plan["refusal"])
    return DoesNotFit(f"the plan does not fit hardware={h['hardware']} as configured ({h['peak_gb']:.1f} GiB per "
                      f"device, {h['usable_gb']:.1f} usable); {change_here(h)}")


def to_json(plan: dict) -> str:
    import json

    return json.dumps(plan, indent=1, default=float)


def render(plan: dict) -> None:
    """The plan as tables on stdout (workbench/plan/tables.py)."""
    show(plan)


__all__ = ["DOES_NOT_FIT_EXIT", "WEIGHTS_FROM", "DoesNotFit", "does_not_fit", "make_plan", "refusal", "render", "to_json"]
