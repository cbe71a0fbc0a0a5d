"""report.md: the short human summary of a run (eval before/after, loss, speed, plots, export).
Accuracies carry their Wilson 95% interval, in the report and in results.json (workbench/evals/stats.py).

    report.write(run_dir, run, results, rows)     # the runner, rank 0, at the end of a run

A run's report embeds the PNGs of workbench/telemetry/plots.py from `<run_dir>/plots/`. Several
runs are compared by workbench/telemetry/compare.py (`python -m workbench.report`).
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.checkpoints import resume_changes
from workbench.evals import stats
from workbench.telemetry import compare, plots, stall
from workbench.train import signal


def evaluations(results: dict, rows: list[dict]) -> list[dict]:
    """Every evaluation of the run with the training step it was taken at."""
    last = rows[-1]["step"] if rows else len(results.get("losses") or [])
    out = []
    if results.get("eval_start"):
        out.append({"step": 0, **results["eval_start"]})
    out += [e for e in results.get("eval_during") or [] if "step" in e]
    if results.get("eval_end"):
        out.append({"step": last, **results["eval_end"]})
    return out


def _acc_rows(results: dict) -> list[str]:
    start, end = results.get("eval_start") or {}, results.get("eval_end") or {}
    # every numeric eval metric (built-in and user hooks, workbench/evals/), less bookkeeping
    keys = sorted({k for k in list(start) + list(end) if k.startswith("eval/") and k.count("/") >= 2
                   and isinstance((start.get(k) if k in start else end.get(k)), (int, float))
                   and k.rsplit("/", 1)[1] not in ("n", "seconds", "tokens")})
    def fmt(ev: dict, k: str) -> str:
        v = ev.get(k)
        if v is None:
            return "-"
        if not k.endswith("accuracy"):
            return f"{v:.4g}"
        ci = stats.intervals(ev).get(f"{k}_ci95")
        return f"{v:.1%} [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else f"{v:.1%}"

    rows = []
    for k in keys:
        fa, fb = fmt(start, k), fmt(end, k)
        name = k.split("/")[1] if k.endswith("/accuracy") else "/".join(k.split("/")[1:])
        rows.append(f"| {name} | {fa} | {fb} |")
    return rows


def _sample(s: dict) -> str:
    if "correct" in s:
        return f"- `{s['prompt']}` -> `{s['completion']}` ({'ok' if s['correct'] else 'expected ' + str(s['answer'])})"
    extra = f" (reward {s['reward']:.3g})" if isinstance(s.get("reward"), (int, float)) else ""
    return f"- `{s['prompt']}` -> `{s['completion']}`{extra}"


def _generations(results: dict) -> list[str]:
    """eval.prompts' completions before and after training (the `generate` task)."""
    before = {g["prompt"]: g["completion"] for g in (results.get("eval_start") or {}).get("generations") or []}
    after = (results.get("eval_end") or {}).get("generations") or []
    if not after and not before:
        return []
    lines = ["", "## Completions of eval.prompts (greedy)", ""]
    for g in after or [{"prompt": p, "completion": None} for p in before]:
        lines += [f"**{g['prompt']}**", ""]
        if g["prompt"] in before:
            lines += [f"- before: {before[g['prompt']]!r}"]
        if g["completion"] is not None:
            lines += [f"- after: {g['completion']!r}"]
        lines.append("")
    return lines


def _stall(stalled: dict | None) -> list[str]:
    """The section of a run that stopped because its steps carried no gradient (workbench/train/signal.py)."""
    if not stalled:
        return []
    out = ["", f"**Stopped early at step {stalled['step']}**: {stalled['reason']}. The evaluation after training "
           f"and the export are of the weights of step {stalled['last_signal_step']}, the last trained with signal"
           + (f" ({stalled['exported_from']})." if stalled.get("exported_from") else "."), "",
           "| metric | first step | at the stop | collapsed |", "|---|---|---|---|"]
    out += [f"| {c['metric']} | {c['start']:.4g} | {c['now']:.4g} | {'yes' if c['collapsed'] else 'no'} |"
            for c in stalled.get("changes", [])]
    return out


def _pairs(rows: list[dict]) -> str:
    return ", ".join(f"`{c['key']}` {c['before']} -> {c['now']}" for c in rows)


def _resume(resumed: dict | None, cfg) -> list[str]:
    """The replay certificate of a resumed run (workbench/checkpoints/replay.py) and the settings the
    resume changed (workbench/checkpoints/resume_changes.py), with the steps each value ran."""
    cert = (resumed or {}).get("certificate")
    if not cert:
        return []
    out = [f"- resume certificate: {'ok' if cert['ok'] else 'FAILED'} ({cert['from']} -> {cert['to']}: probe loss "
           f"{cert['probe_loss']:.8g} saved, {cert['probe_loss_resumed']:.8g} resumed, relative difference "
           f"{cert['rel_diff']:.2e}, tolerance {cert['tolerance']:.1e}); {resumed.get('batch', '')}"]
    changes = resumed.get("changes") or {}
    if changes.get("result"):
        found = resume_changes.Changes(since=changes["since"], result=[(c["key"], c["before"], c["now"])
                                                                       for c in changes["result"]],
                                       from_step=changes.get("from_step"))
        out.append(f"- **changed on resume from {changes['since']}, changing what the steps after it compute** "
                   f"(train.resume_changes=allow): {_pairs(changes['result'])}; "
                   f"{resume_changes.steps_note(found, int(cfg.train.max_steps))}")
    if changes.get("other"):
        out.append(f"- changed on resume from {changes['since']} (what a step computes unchanged): "
                   f"{_pairs(changes['other'])}")
    return out


def whole_run(run_dir: Path, rows: list[dict], last_step: int | None) -> list[dict]:
    """The training rows of the whole run, from metrics.jsonl: a resumed run's report covers the
    launches before it too. A step logged twice (trained again after a crash resumed from an
    earlier checkpoint) counts once, as last trained; steps after `last_step` (logged by a launch
    that crashed past this run's last checkpoint and were trained again) are not this run's.
    `rows`: this launch's, used when the file is missing."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return rows
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError:
            continue  # a line cut short by a crash
        if "loss" in row and "step" in row and "eval" not in row:
            by_step[int(row["step"])] = row
    for row in rows:  # this launch's, as it logged them
        by_step[int(row["step"])] = row
    return [by_step[k] for k in sorted(by_step) if last_step is None or k <= last_step]


def _launches(history: list[dict] | None, last_step: int) -> list[str]:
    """One line per launch of a run resumed more than once ("steps 1-8: a new run; 9-12: resumed
    from step-00000008, optim.lr 0.0002 -> 0.001")."""
    if not history or len(history) < 2:
        return []
    parts = []
    for i, h in enumerate(history):
        end = history[i + 1]["first_step"] - 1 if i + 1 < len(history) else last_step
        span = f"{h['first_step']}-{end}" if end > h["first_step"] else f"{h['first_step']}"
        what = f"resumed from {h['resumed_from']}" if h.get("resumed_from") else "a new run"
        changed = (h.get("result") or []) + (h.get("other") or [])
        if changed:
            what += ", " + _pairs(changed)
        parts.append(f"steps {span}: {what}" if end >= h["first_step"] else f"{what} (no step trained)")
    return [f"- launches: {len(history)}; " + "; ".join(parts)]


def _earlier(run_dir: Path, results: dict) -> dict:
    """A resumed run's evaluation before training (and during it, up to the resume), kept from the
    results.json of the launch that ran it, so the report's "before" column is the run's."""
    path = Path(run_dir) / "results.json"
    if not results.get("resumed_from") or results.get("eval_start") or not path.exists():
        return results
    try:
        before = json.loads(path.read_text())
    except ValueError:
        return results
    out = dict(results)
    if before.get("eval_start"):
        out["eval_start"] = before["eval_start"]
    history = (results.get("resume") or {}).get("history") or []
    first = history[-1]["first_step"] if history else None  # this launch's first step
    kept = [e for e in before.get("eval_during") or [] if isinstance(e, dict) and first and e.get("step", 0) < first]
    if kept:
        out["eval_during"] = kept + [e for e in results.get("eval_during") or [] if e not in kept]
    return out


def _plan_check(check: dict | None) -> list[str]:
    """The planner's prediction against the run (workbench/plan/check.py)."""
    if not check or not check.get("figures"):
        return []
    out = ["", f"Plan check after {check['steps']} steps (measured / predicted; more than 20% off is flagged):", "",
           "| figure | predicted | measured | ratio |", "|---|---|---|---|"]
    out += [f"| {k}{' (off)' if k in check['off'] else ''} | {f['predicted']:.4g} | {f['measured']:.4g} | "
            f"{f['ratio']:.2f} |" for k, f in check["figures"].items()]
    return out


def write(run_dir: Path, run, results: dict, rows: list[dict]) -> None:
    """`run`: the resolved run (workbench/resolve/resolved.py)."""
    cfg = run.cfg
    run_dir = Path(run_dir)
    launch = results.get("losses") or []  # this launch's steps; the report is the whole run's
    last = rows[-1]["step"] if rows else None
    rows = whole_run(run_dir, rows, last)
    results = _earlier(run_dir, results)
    losses = [r["loss"] for r in rows] if rows else launch
    tps = compare.step_median(rows, "tokens_per_s")
    resumed = results.get("resumed_from")
    this = f"; {len(launch)} in this launch, resumed from {resumed}" if resumed else ""
    lines = [
        f"# Run report: {cfg.method.name} on {cfg.model.name} (peft={run.peft.kind}, backend={cfg.backend.name}, "
        f"precision={run.precision.name})", "",
        f"- steps: {len(losses)}{this}" if resumed else f"- steps: {len(losses)} (resumed from: no)",
        f"- parameters: {results.get('n_params', 0):,} total, {results.get('n_trainable', 0):,} trainable",
    ]
    lines += _launches((results.get("resume") or {}).get("history"), last or len(losses))
    if losses:
        lines.append(f"- loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    lines += [f"- **{line}**" for line in stall.end_lines(results)]  # the loss watch's warnings
    spread = signal.steps_with_signal(rows)
    if spread:
        lines.append(f"- reward spread: {spread[0]} of {spread[1]} steps had groups with reward spread (on average "
                     f"{spread[2]:.0%} of a step's groups); a group whose completions all scored the same adds no "
                     "gradient")
    if tps is not None:  # medians as `python -m workbench.report` takes them (compare.step_median)
        mfu = compare.step_median(rows, "mfu")
        extra = f", MFU {mfu:.1%} (peak {results.get('peak_flops', 0) / 1e9:,.0f} GFLOP/s, " \
                f"{results.get('peak_source', '?')})" if mfu is not None else ""
        lines.append(f"- throughput: median {tps:.0f} tokens/s{extra}")
    if results.get("first_step_seconds") is not None:
        lines.append(f"- first optimizer step {results['first_step_seconds']:.1f} s after start; "
                     f"wall {results.get('wall_seconds', 0):.0f} s (this launch: conversion, training, "
                     "evaluation, export)")
    lines += _resume(results.get("resume"), cfg)  # reads train.max_steps only for a resumed run
    lines += _stall(results.get("stalled"))
    lines += _plan_check(results.get("plan_check"))
    acc = _acc_rows(results)
    if acc:
        lines += ["", "| eval | before | after |", "|---|---|---|", *acc]
        if any(stats.intervals(ev) for ev in (results.get("eval_start") or {}, results.get("eval_end") or {})):
            lines += ["", "Accuracies: [Wilson 95% interval over the questions evaluated]."]
    samples = (results.get("eval_end") or {}).get("samples") or {}
    for task, items in samples.items():
        lines += ["", f"Samples ({task}, after training):", ""]
        lines += [_sample(s) for s in items]
    lines += _generations(results)
    figures = plots.run_plots(rows, evaluations(results, rows), run_dir / "plots") if cfg.train.plots else []
    if figures:
        lines += ["", "## Plots", ""] + [f"![{title}](plots/{path.name})" for title, path in figures]
    if results.get("export"):
        lines += ["", "Export:", "", "```", json.dumps(results["export"], indent=1), "```"]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    slim = {k: v for k, v in results.items() if k != "losses"}
    losses = launch  # results.json keeps this launch's losses (what the runner returned)
    # eval/<task>/accuracy_ci95: [lo, hi] beside each accuracy measured on n questions; only in the
    # file, so the in-memory results stay {metric: number}
    for key in ("eval_start", "eval_end"):
        if isinstance(slim.get(key), dict):
            slim[key] = {**slim[key], **stats.intervals(slim[key])}
    if isinstance(slim.get("eval_during"), list):
        slim["eval_during"] = [{**e, **stats.intervals(e)} if isinstance(e, dict) else e for e in slim["eval_during"]]
    (run_dir / "results.json").write_text(json.dumps({**slim, "losses": losses}, indent=1, default=str))
