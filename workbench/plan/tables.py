"""The plan as rich tables on stdout, for people (plan.json=true gives the same as JSON).

Everything is laid out for 100 columns (a terminal, a pipe or a log file alike): the tables hold
numbers, and what is long (a change of several overrides, a note) is a line of its own below,
which wraps at spaces.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

WIDTH = 100


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


def tokens_line(plan: dict) -> str:
    """The token count with where it comes from: with train.max_steps it is steps x the global
    batch, and the global batch is micro-batches per rank x data-parallel ranks, so the count
    follows the devices of the configured hardware."""
    t, f = plan["tokens"], plan.get("tokens_from")
    if not f or f["plan_tokens"]:
        return f"tokens: {t:,.0f} (plan.tokens)"
    dp, accum = f["data_parallel"], f["grad_accum"]
    return (f"tokens: {t:,.0f} = {f['steps']:,} steps x {dp} data-parallel rank{'s' * (dp != 1)} x "
            f"{accum} micro-batch{'es' * (accum != 1)} x {f['tokens_per_micro']:,} tokens: every data-parallel "
            "rank takes its own micro-batches, so the count grows with the devices (plan.tokens fixes it)")


def needed_how(need: dict) -> str:
    """How a run fits on the devices `devices_needed` counted (workbench/plan/fit.py)."""
    return "activation checkpointing" + (f" and backend={need['backend']}" if need.get("backend") else "")


def change_here(row: dict) -> str:
    """The smallest change that fits on a row's hardware that does not fit, in words."""
    if row["fix"]:
        return (f"smallest change that fits here: {row['fix']}"
                + (f" ({row['fix_peak_gb']:.1f} GiB per device)" if row.get("fix_peak_gb") else ""))
    need = row.get("needed")
    if need:
        return f"smallest change that fits: {need['devices']} devices of hardware={row['hardware']} with {needed_how(need)}"
    return f"no change the planner tries fits on hardware={row['hardware']}"


def change_line(r: dict) -> str:
    """A row that does not fit: the smallest change that does, and the devices it needs."""
    line = f"{r['hardware']}: does not fit; {change_here(r)}"
    need = r.get("needed")
    if r["fix"] and need and need["devices"] > r["devices"]:
        line += f"; or {need['devices']} devices with {needed_how(need)}"
    if need and need["devices"] > r["devices"] and need["hours"] is not None:
        line += f" ({duration(need['hours'])}" + (f", {money(need['cost_usd'])})" if need["cost_usd"] else ")")
    return line


WITH_CHANGE = "with change"  # the fits cell of a row whose speed columns are the changed run's


def show(plan: dict, console: Console | None = None) -> None:
    con = console or Console(highlight=False)
    con.width = min(con.width, WIDTH) if con.is_terminal else WIDTH
    p = plan["params"]
    con.print(f"[bold]plan[/bold] model={plan['model']} method={plan['method']} peft={plan['peft']} "
              f"backend={plan['backend']} precision={plan['precision']}: {p['total']:,} params "
              f"({p['active']:,} active, {p['trainable']:,} trainable), MFU {plan['mfu']:.0%}")
    con.print(tokens_line(plan))
    mem = Table(title="memory per device (GiB)")  # per device of the layout in the title below
    mem.add_column("term")
    mem.add_column("GiB", justify="right")
    for k, v in plan["memory_gb"].items():
        name = "weights (2 models, see below)" if k == "weights" and plan.get("hf_copy_gb") else k
        mem.add_row(name, f"{v:.3f}")
    con.print(mem)
    for note in plan.get("notes", []):
        con.print(note)
    rows = [plan["here"], *plan["profiles"]] if plan.get("compare") else [plan["here"]]
    t = Table(title="where it runs" + ("" if plan.get("compare") else
                                       f" on hardware={plan['here']['hardware']} (plan.compare=true: every profile)"))
    for col in ("hardware", "devices", "GiB/device", "usable", "fits", "tokens/s", "time", "cost"):
        t.add_column(col, justify="left" if col == "hardware" else "right")
    for r in rows:
        fits = "yes" if r["fits"] else WITH_CHANGE if r["fix"] and r["tokens_per_s"] else "no"
        t.add_row(r["hardware"], str(r["devices"]), f"{r['peak_gb']:.1f}", f"{r['usable_gb']:.1f}", fits,
                  f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-", duration(r["hours"]),
                  money(r["cost_usd"]))
    con.print(t)
    for r in rows[1:]:  # the configured hardware's is the verdict below
        if not r["fits"]:
            con.print(change_line(r))
    if any(not r["fits"] and r["fix"] and r["tokens_per_s"] for r in rows):
        con.print(f"fits '{WITH_CHANGE}': tokens/s, time and cost are the run's with the smallest change that fits")
    cal = plan["here"].get("calibrated")
    if cal:  # workbench/plan/check.py: an earlier run on this hardware measured the plan
        con.print(f"hardware={plan['here']['hardware']}: calibrated by the run {cal['from']} ({cal['time']}): "
                  f"memory x{cal.get('peak_gib') or 1:.2f}, tokens/s x{cal.get('tokens_per_s') or 1:.2f} "
                  "(measured/predicted, plan.calibrate=true)")
    over = plan["here"].get("cores")
    if plan.get("refusal"):
        con.print(f"verdict: does not fit hardware={plan['here']['hardware']} as configured: {plan['refusal']}")
    elif over:
        con.print(f"hardware.procs asks for {over['asked']} processes on {over['available']} CPU cores: "
                  f"set hardware.procs<={over['available']}")
    else:
        h = plan["here"]
        con.print(f"verdict: fits hardware={h['hardware']} ({h['peak_gb']:.1f} GiB per device of "
                  f"{h['usable_gb']:.1f} usable)")
    dated = next((r["price_date"] for r in rows if r.get("price_date")), None)
    con.print((f"prices per device-hour as quoted {dated}; " if dated else "")
              + "time and cost: the whole job on all of a profile's devices, where it fits, at the "
              "listed MFU (set plan.mfu, plan.tokens)")
