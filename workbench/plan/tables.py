"""The plan as rich tables on stdout, for people (plan.json=true gives the same as JSON)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def money(cost) -> str:
    if not cost:
        return "-"
    fmt = "{:,.2f}" if cost[1] < 100 else "{:,.0f}"
    return f"${fmt.format(cost[0])}-{fmt.format(cost[1])}"


def duration(h) -> str:
    if h is None:
        return "-"
    if h >= 48:
        return f"{h / 24:.1f} d"
    return f"{h:.1f} h" if h >= 1 else f"{h * 60:.1f} min" if h * 60 >= 1 else f"{h * 3600:.1f} s"


def show(plan: dict, console: Console | None = None) -> None:
    con = console or Console(highlight=False)
    if not con.is_terminal:
        con.width = max(con.width, 150)  # a pipe or a log file: do not wrap the table at 80 columns
    p = plan["params"]
    con.print(f"[bold]plan[/bold] model={plan['model']} method={plan['method']} peft={plan['peft']} "
              f"backend={plan['backend']} precision={plan['precision']}: {p['total']:,} params "
              f"({p['active']:,} active, {p['trainable']:,} trainable), {plan['tokens']:,.0f} tokens, "
              f"MFU {plan['mfu']:.0%}")
    mem = Table(title=f"memory per device on hardware={plan['here']['hardware']} (GiB)")
    mem.add_column("term")
    mem.add_column("GiB", justify="right")
    for k, v in plan["memory_gb"].items():
        mem.add_row(k, f"{v:.3f}")
    con.print(mem)
    rows = [plan["here"], *plan["profiles"]] if plan.get("compare") else [plan["here"]]
    t = Table(title="where it runs" + ("" if plan.get("compare") else
                                       f" on hardware={plan['here']['hardware']} (plan.compare=true lists every profile)"))
    cols = ("hardware", "devices", "GiB/device", "usable", "fits", "smallest change / devices needed",
            "tokens/s (all devices)", "time (whole job)", "cost (whole job, all devices)")
    for col in cols:
        t.add_column(col, justify="right" if col not in ("hardware", "smallest change / devices needed") else "left")
    for r in rows:
        if r["fits"]:
            fix = ""
        else:
            fix = r["fix"] or ""
            need = r.get("needed")
            if need and need["devices"] > r["devices"]:
                fix = (fix + "; " if fix else "") + f"{need['devices']} devices (fsdp2"
                fix += (f": {duration(need['hours'])}, {money(need['cost_usd'])})" if need["hours"] is not None else ")")
        t.add_row(r["hardware"], str(r["devices"]), f"{r['peak_gb']:.1f}", f"{r['usable_gb']:.1f}",
                  "yes" if r["fits"] else "no", fix or "-",
                  f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", duration(r["hours"]),
                  money(r["cost_usd"]))
    con.print(t)
    cal = plan["here"].get("calibrated")
    if cal:  # workbench/telemetry/plan_check.py: an earlier run on this hardware measured the plan
        con.print(f"hardware={plan['here']['hardware']}: calibrated by the run {cal['from']} ({cal['time']}): "
                  f"memory x{cal.get('peak_gib') or 1:.2f}, tokens/s x{cal.get('tokens_per_s') or 1:.2f} "
                  "(measured/predicted, plan.calibrate=true)")
    over = plan["here"].get("cores")
    if plan.get("refusal"):
        con.print(f"not on hardware={plan['here']['hardware']} as configured: {plan['refusal']}")
    elif over:
        con.print(f"hardware.procs asks for {over['asked']} processes on {over['available']} CPU cores: "
                  f"set hardware.procs<={over['available']}")
    dated = next((r["price_date"] for r in rows if r.get("price_date")), None)
    con.print((f"prices per device-hour as quoted {dated}; " if dated else "")
              + f"time and cost: all {plan['tokens']:,.0f} tokens of the job on all of a profile's devices, "
              "where the run fits, at the listed MFU (set plan.mfu, plan.tokens)")
