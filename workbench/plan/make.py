"""The plan of one run: `make_plan(cfg)` and the one-line refusal of a run that does not fit.

Fields owned by one backend or method (stage, offload, generations) are read by their schema
names with defaults (`pick`), so the planner works for any backend or method config; precision,
peft, the reference and the layout come from the derived run (workbench/config/run.py).
"""

from __future__ import annotations

from dataclasses import asdict

from workbench.config.run import derive
from workbench.config.schema import pick
from workbench.methods import registry
from workbench.plan import catalog
from workbench.plan.counts import count, probe
from workbench.plan.fit import GiB, verdict
from workbench.plan.memory import estimate, tokens_per_micro
from workbench.plan.setup import Setup
from workbench.plan.speed import speed, train_flops_per_token
from workbench.plan.tables import money, show
from workbench.train.distributed import requested_procs


def _flag(value) -> bool:
    if isinstance(value, str):
        return value.lower() not in ("", "none", "false", "no", "0")
    return bool(value)


def from_cfg(cfg, devices: int | None = None) -> Setup:
    """Fields by their schema names (a backend or method without one gets the default)."""
    backend = pick(cfg, "backend.name", "single")
    stage = int(pick(cfg, "backend.stage", 3 if backend == "fsdp2" else 0))
    ckpt = pick(cfg, "backend.activation_checkpointing" if backend != "megatron" else "backend.recompute", None)
    if ckpt is None or not _flag(ckpt):
        ckpt = "full" if cfg.model.gradient_checkpointing else "none"
    elif ckpt not in ("selective",):
        ckpt = "full"
    method = pick(cfg, "method.name", "sft")
    use_vllm = registry.spec(method).facts.generates and pick(cfg, "method.engine", "hf") == "vllm"
    run = derive(cfg)  # precision, peft and the reference strategy, as the run will have them
    ref = {"precomputed": "precompute"}.get(run.reference, run.reference)
    host = _flag(pick(cfg, "backend.cpu_offload", False))  # fsdp2: parameters, gradients and optimizer state
    return Setup(
        method=method, peft=run.peft.kind, lora_r=int(cfg.peft.r), double_quant=bool(cfg.peft.double_quant),
        precision=run.precision.name, optimizer=cfg.optim.name, backend=backend, stage=stage,
        offload_optimizer=host or _flag(pick(cfg, "backend.offload_optimizer", False)),
        offload_params=host or _flag(pick(cfg, "backend.offload_param", False)),
        devices=devices or run.layout.world, device=cfg.hardware.device,
        tp=run.layout.tp, pp=run.layout.pp, cp=run.layout.cp, ep=int(pick(cfg, "backend.ep", 1)),
        micro_batch=cfg.train.micro_batch_size, grad_accum=cfg.train.grad_accum, seq_len=cfg.data.seq_len,
        checkpointing=ckpt, checkpoint_every=int(pick(cfg, "backend.selective_every", 2)),
        select_fraction=float(pick(cfg, "plan.select_fraction", 1.0)),
        dpo_ref=ref, teacher_scale=float(pick(cfg, "plan.teacher_scale", 1.0)),
        generations=int(pick(cfg, "method.num_generations", 8)),
        completion_len=int(pick(cfg, "method.max_new_tokens", 256)),
        vllm_fraction=float(pick(cfg, "method.vllm_gpu_memory_utilization", 0.3)) if use_vllm else 0.0,
        distributed_optimizer=backend == "megatron" and _flag(pick(cfg, "backend.distributed_optimizer", False)),
        hf_copy=backend == "megatron" and run.keeps_hf_base,
    )


def run_tokens(cfg, s) -> float:
    """Tokens the run trains on: plan.tokens, else max_steps x global batch x sequence."""
    explicit = float(pick(cfg, "plan.tokens", 0) or 0)
    if explicit > 0:
        return explicit
    return float(cfg.train.max_steps * cfg.train.grad_accum * s.dp * tokens_per_micro(s))


def _peak_tflops(hw, precision: str) -> float:
    """The datasheet figure of the profile; for this machine's CPU (no datasheet) the matmul rate
    measured here, the peak a run's MFU is taken against (workbench/telemetry/peak.py)."""
    tflops = catalog.peak_tflops(hw, precision)
    if not tflops and hw.device == "cpu":
        from workbench.telemetry.peak import measured_peak_flops
        from workbench.train import precision as prec

        tflops = measured_peak_flops("cpu", prec.spec(precision)) / 1e12
    return tflops


def _row(cfg, counts, name, hw, mfu, devices: int | None = None, calibrated: bool = False) -> dict:
    """The verdict on hardware profile `hw`: with the processes it asks for, or `devices`;
    `calibrated`: with the measured/predicted ratios an earlier run stored for it."""
    devices = devices or requested_procs(hw)
    s = from_cfg(cfg, devices=devices)
    mem = catalog.memory_gb(hw)
    if hw.device == "cpu":
        mem /= devices  # CPU processes share the host's memory
    v = verdict(counts, cfg.model.arch, s, mem, hw.device, node_size=hw.procs)
    trainable = counts.total if s.peft == "none" else counts.lora
    fpt = train_flops_per_token(counts.active, trainable, s.peft, s.method, s.dpo_ref)
    tokens = run_tokens(cfg, s)
    need = v.devices_needed if not v.fits else devices
    sp = speed(tokens, fpt, need or devices, _peak_tflops(hw, s.precision), mfu,
               list(hw.price_per_hour) or None)
    ratios = None
    if calibrated:  # measured/predicted of an earlier run on this hardware (plan.calibrate=true)
        from workbench.telemetry.plan_check import calibration

        ratios = calibration(hw, s.precision, cfg.model.name)
    if ratios:
        v_peak = v.peak_gb * ratios.get("peak_gib", 1.0)
        sp = speed(tokens, fpt, need or devices, _peak_tflops(hw, s.precision) * ratios.get("tokens_per_s", 1.0),
                   mfu, list(hw.price_per_hour) or None) if sp else None
    row = {
        "hardware": name, "device": hw.device, "accelerator": hw.accelerator, "devices": devices, "memory_gb": mem,
        "peak_gb": round(v.peak_gb, 2), "usable_gb": round(v.usable_gb, 2), "fits": v.fits,
        "fix": v.fix, "fix_peak_gb": round(v.fix_peak_gb, 2) if v.fix_peak_gb else None,
        "devices_needed": v.devices_needed,
        "tokens_per_s": sp.tokens_per_s if sp else None, "hours": sp.hours if sp else None,
        "cost_usd": list(sp.cost) if sp and sp.cost else None,
        "price_per_hour": list(hw.price_per_hour), "price_date": hw.price_date,
        "flops_per_token": fpt,
    }
    if ratios:
        row.update(peak_gb=round(v_peak, 2), fits=v_peak <= v.usable_gb,
                   calibrated={"from": ratios.get("run"), "time": ratios.get("time"),
                               "peak_gib": ratios.get("peak_gib"), "tokens_per_s": ratios.get("tokens_per_s")})
    return row


def make_plan(cfg, counts=None, hardware: list[str] | None = None, others: bool = True,
              calibrated: bool = True) -> dict:
    """The plan as plain data (JSON-ready). `counts` may come from preflight's meta probe.
    others=False leaves out the rest of the catalog (a run that fits where it is needs only `here`);
    calibrated=False: the planner's own figures for this hardware, without an earlier run's ratios."""
    counts = counts or count(probe(cfg.model), cfg.model.arch, cfg.peft)
    mfu = float(pick(cfg, "plan.mfu", 0.4))
    s = from_cfg(cfg)
    est = estimate(counts, cfg.model.arch, s)
    here = _row(cfg, counts, cfg.hardware.name, cfg.hardware, mfu, devices=derive(cfg).layout.world,
                calibrated=calibrated)
    wanted = hardware or list(pick(cfg, "plan.hardware", []) or [])
    rows = [_row(cfg, counts, name, hw, mfu) for name, hw in catalog.profiles().items()
            if (not wanted or name in wanted) and name != cfg.hardware.name] if others else []
    return {
        "model": cfg.model.name, "method": s.method, "peft": s.peft, "backend": s.backend,
        "precision": s.precision,
        "params": {"total": counts.total, "active": counts.active,
                   "trainable": counts.total if s.peft == "none" else counts.lora},
        "tokens": run_tokens(cfg, s), "mfu": mfu,
        "setup": asdict(s),
        "memory_gb": {k: round(v / GiB, 3) for k, v in est.terms().items()} | {"peak": round(est.peak / GiB, 3),
                                                                              "host": round(est.host / GiB, 3)},
        "here": here,
        "profiles": rows,
    }


def refusal(plan: dict) -> str:
    """One line for a run that does not fit where it was asked to run."""
    h = plan["here"]
    runnable = [r for r in plan["profiles"] if r["device"] in ("cuda", "cpu")] or plan["profiles"]
    fits = [r for r in runnable if r["fits"]]
    best = min(fits, key=lambda r: (r["cost_usd"] or [1e18])[0]) if fits else None
    msg = (f"model={plan['model']} method={plan['method']} peft={plan['peft']} needs "
           f"{h['peak_gb']:.1f} GiB per device but hardware={h['hardware']} has {h['usable_gb']:.1f} GiB usable")
    if h["fix"]:
        msg += f"; smallest change that fits here: {h['fix']}"
    if best:
        cost = best["cost_usd"]
        msg += (f"; it fits on hardware={best['hardware']} ({best['devices']} x {best['accelerator']}, "
                f"{best['peak_gb']:.1f} GiB/device" + (f", ~{best['hours']:.1f} h, {money(cost)}"
                                                       if cost else "") + ")")
    else:
        needs = [r for r in runnable if r["devices_needed"]]
        if needs:
            r = min(needs, key=lambda r: (r["cost_usd"] or [1e18])[0])
            how = "activation checkpointing" + (" and backend=fsdp2" if r["devices_needed"] > 1 else "")
            msg += (f"; it fits on {r['devices_needed']} x {r['accelerator']} with {how} "
                    f"(hardware={r['hardware']}" + (f", ~{r['hours']:.1f} h, {money(r['cost_usd'])}"
                                                    if r["cost_usd"] else "") + ")")
    return msg + ". See the plan: add dry_run=true"


def to_json(plan: dict) -> str:
    import json

    return json.dumps(plan, indent=1, default=float)


def render(plan: dict) -> None:
    """The plan as tables on stdout (workbench/plan/tables.py)."""
    show(plan)


__all__ = ["make_plan", "refusal", "render", "to_json"]
