"""The planner: will this run fit, where, how fast and for how much - before any weights load.

    python -m workbench dry_run=true method=dpo model=70b                 # rich table
    python -m workbench dry_run=true model=70b plan.json=true             # JSON for tools
    python -m workbench dry_run=true model=70b plan.mfu=0.35 plan.tokens=1e9

`make_plan(cfg)` counts parameters exactly on a meta-device probe (counts.py), estimates
per-device memory term by term (memory.py), gives a verdict for the configured hardware and
every profile in conf/hardware/ with the smallest change that fits (fit.py), and the time and
cost of the run's tokens at plan.mfu (speed.py).
"""

from __future__ import annotations

from dataclasses import asdict

from workbench.plan import catalog
from workbench.plan.counts import count, probe
from workbench.plan.fit import GiB, verdict
from workbench.plan.memory import estimate, tokens_per_micro
from workbench.plan.setup import from_cfg, pick
from workbench.plan.speed import speed, train_flops_per_token


def run_tokens(cfg, s) -> float:
    """Tokens the run trains on: plan.tokens, else max_steps x global batch x sequence."""
    explicit = float(pick(cfg, "plan.tokens", 0) or 0)
    if explicit > 0:
        return explicit
    return float(cfg.train.max_steps * cfg.train.grad_accum * s.dp * tokens_per_micro(s))


def _row(cfg, counts, name, hw, mfu) -> dict:
    devices = hw.procs * hw.nodes
    s = from_cfg(cfg, devices=devices)
    mem = catalog.memory_gb(hw)
    if hw.device == "cpu":
        mem /= devices  # CPU processes share the host's memory
    v = verdict(counts, cfg.model.arch, s, mem, hw.device, node_size=hw.procs)
    trainable = counts.total if s.peft == "none" else counts.lora
    fpt = train_flops_per_token(counts.active, trainable, s.peft, s.method, s.dpo_ref)
    tokens = run_tokens(cfg, s)
    need = v.devices_needed if not v.fits else devices
    sp = speed(tokens, fpt, need or devices, catalog.peak_tflops(hw, s.precision), mfu,
               list(hw.price_per_hour) or None)
    return {
        "hardware": name, "device": hw.device, "accelerator": hw.accelerator, "devices": devices, "memory_gb": mem,
        "peak_gb": round(v.peak_gb, 2), "usable_gb": round(v.usable_gb, 2), "fits": v.fits,
        "fix": v.fix, "fix_peak_gb": round(v.fix_peak_gb, 2) if v.fix_peak_gb else None,
        "devices_needed": v.devices_needed,
        "tokens_per_s": sp.tokens_per_s if sp else None, "hours": sp.hours if sp else None,
        "cost_usd": list(sp.cost) if sp and sp.cost else None,
        "price_per_hour": list(hw.price_per_hour), "price_date": hw.price_date,
    }


def make_plan(cfg, counts=None, hardware: list[str] | None = None, others: bool = True) -> dict:
    """The plan as plain data (JSON-ready). `counts` may come from preflight's meta probe.
    others=False leaves out the rest of the catalog (a run that fits where it is needs only `here`)."""
    counts = counts or count(probe(cfg.model), cfg.model.arch, cfg.peft)
    mfu = float(pick(cfg, "plan.mfu", 0.4))
    s = from_cfg(cfg)
    est = estimate(counts, cfg.model.arch, s)
    here = _row(cfg, counts, cfg.hardware.name, cfg.hardware, mfu)
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


def money(cost) -> str:
    if not cost:
        return "-"
    fmt = "{:,.2f}" if cost[1] < 100 else "{:,.0f}"
    return f"${fmt.format(cost[0])}-{fmt.format(cost[1])}"


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


# Imported here, before `render` below is defined: importing the submodule `render` binds it as
# this package's attribute, and done lazily inside the function it replaced the function after
# the first call (a second dry run in one process then called a module).
from workbench.plan.render import show as _show  # noqa: E402


def render(plan: dict) -> None:
    _show(plan)


__all__ = ["make_plan", "refusal", "render", "to_json"]
