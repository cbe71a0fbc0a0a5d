"""report.md: the short human summary of a run (eval before/after, loss, speed, plots, export).
Accuracies carry their Wilson 95% interval, in the report and in results.json (workbench/evals/stats.py).

    report.write(run_dir, run, results, rows)     # the runner, rank 0, at the end of a run

A run's report embeds the PNGs of workbench/telemetry/plots.py from `<run_dir>/plots/`. Several
runs are compared by workbench/telemetry/compare.py (`python -m workbench.report`).
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _resume(resumed: dict | None) -> list[str]:
    """The replay certificate of a resumed run (workbench/train/replay.py) and the settings the
    resume changed (workbench/train/resume_changes.py)."""
    cert = (resumed or {}).get("certificate")
    if not cert:
        return []
    out = [f"- resume certificate: {'ok' if cert['ok'] else 'FAILED'} ({cert['from']} -> {cert['to']}: probe loss "
           f"{cert['probe_loss']:.8g} saved, {cert['probe_loss_resumed']:.8g} resumed, relative difference "
           f"{cert['rel_diff']:.2e}, tolerance {cert['tolerance']:.1e}); {resumed.get('batch', '')}"]
    changes = resumed.get("changes") or {}
    if changes.get("result"):
        out.append(f"- **changed on resume from {changes['since']}, changing what the steps after it compute** "
                   f"(train.resume_changes=allow): {_pairs(changes['result'])}; the steps before it ran with the "
                   "earlier values")
    if changes.get("other"):
        out.append(f"- changed on resume from {changes['since']} (what a step computes unchanged): "
                   f"{_pairs(changes['other'])}")
    return out


def _plan_check(check: dict | None) -> list[str]:
    """The planner's prediction against the run (workbench/telemetry/plan_check.py)."""
    if not check or not check.get("figures"):
        return []
    out = ["", f"Plan check after {check['steps']} steps (measured / predicted; more than 20% off is flagged):", "",
           "| figure | predicted | measured | ratio |", "|---|---|---|---|"]
    out += [f"| {k}{' (off)' if k in check['off'] else ''} | {f['predicted']:.4g} | {f['measured']:.4g} | "
            f"{f['ratio']:.2f} |" for k, f in check["figures"].items()]
    return out


def write(run_dir: Path, run, results: dict, rows: list[dict]) -> None:
    """`run`: the resolved run (workbench/run/resolved.py)."""
    cfg = run.cfg
    run_dir = Path(run_dir)
    losses = results.get("losses") or []
    tps = compare.step_median(rows, "tokens_per_s")
    lines = [
        f"# Run report: {cfg.method.name} on {cfg.model.name} (peft={run.peft.kind}, backend={cfg.backend.name}, "
        f"precision={run.precision.name})", "",
        f"- steps: {len(losses)} (resumed from: {results.get('resumed_from') or 'no'})",
        f"- parameters: {results.get('n_params', 0):,} total, {results.get('n_trainable', 0):,} trainable",
    ]
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
                     f"wall {results.get('wall_seconds', 0):.0f} s")
    lines += _resume(results.get("resume"))
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
    # eval/<task>/accuracy_ci95: [lo, hi] beside each accuracy measured on n questions; only in the
    # file, so the in-memory results stay {metric: number}
    for key in ("eval_start", "eval_end"):
        if isinstance(slim.get(key), dict):
            slim[key] = {**slim[key], **stats.intervals(slim[key])}
    if isinstance(slim.get("eval_during"), list):
        slim["eval_during"] = [{**e, **stats.intervals(e)} if isinstance(e, dict) else e for e in slim["eval_during"]]
    (run_dir / "results.json").write_text(json.dumps({**slim, "losses": losses}, indent=1, default=str))
