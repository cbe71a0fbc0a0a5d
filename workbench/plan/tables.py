"""The plan as rich tables on stdout, for people (plan.json=true gives the same as JSON)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def money(cost) -> str:
    if not cost:
        return "-"
    fmt = "{:,.2f}" if cost[1] < 100 else "{:,.0f}"
    return f"${fmt.format(cost[0])}-{fmt.format(cost[1])}"


def _hours(h) -> str:
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
    t = Table(title="where it runs")
    for col in ("hardware", "devices", "GiB/device", "usable", "fits", "smallest change / devices needed",
                "tokens/s", "time", "cost"):
        t.add_column(col, justify="right" if col not in ("hardware", "smallest change / devices needed") else "left")
    for r in [plan["here"], *plan["profiles"]]:
        if r["fits"]:
            fix = ""
        else:
            fix = r["fix"] or ""
            if r["devices_needed"] and r["devices_needed"] > r["devices"]:
                fix = (fix + "; " if fix else "") + f"{r['devices_needed']} devices (fsdp2)"
        t.add_row(r["hardware"], str(r["devices"]), f"{r['peak_gb']:.1f}", f"{r['usable_gb']:.1f}",
                  "yes" if r["fits"] else "no", fix or "-",
                  f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", _hours(r["hours"]),
                  money(r["cost_usd"]))
    con.print(t)
    cal = plan["here"].get("calibrated")
    if cal:  # workbench/telemetry/plan_check.py: an earlier run on this hardware measured the plan
        con.print(f"hardware={plan['here']['hardware']}: calibrated by the run {cal['from']} ({cal['time']}): "
                  f"memory x{cal.get('peak_gib') or 1:.2f}, tokens/s x{cal.get('tokens_per_s') or 1:.2f} "
                  "(measured/predicted, plan.calibrate=true)")
    con.print(f"prices per device-hour as quoted {plan['profiles'][0]['price_date'] if plan['profiles'] else ''}; "
              "time and cost at the listed MFU for the devices that fit (set plan.mfu, plan.tokens)")
