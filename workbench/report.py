"""report.md: the short human summary of a run (eval before/after, loss, speed, export)."""

from __future__ import annotations

import json
from pathlib import Path


def _acc_rows(results: dict) -> list[str]:
    start, end = results.get("eval_start") or {}, results.get("eval_end") or {}
    keys = sorted({k for k in list(start) + list(end) if k.endswith("/accuracy")})
    rows = []
    for k in keys:
        a, b = start.get(k), end.get(k)
        fa = f"{a:.1%}" if a is not None else "-"
        fb = f"{b:.1%}" if b is not None else "-"
        rows.append(f"| {k.split('/')[1]} | {fa} | {fb} |")
    return rows


def write(run_dir: Path, cfg, results: dict, rows: list[dict]) -> None:
    run_dir = Path(run_dir)
    losses = results.get("losses") or []
    tps = [r["tokens_per_s"] for r in rows[1:]] or [r["tokens_per_s"] for r in rows]
    lines = [
        f"# Run report: {cfg.method.name} on {cfg.model.name} (peft={cfg.peft.kind}, backend={cfg.backend.name}, "
        f"precision={cfg.precision.name})", "",
        f"- steps: {len(losses)} (resumed from: {results.get('resumed_from') or 'no'})",
        f"- parameters: {results.get('n_params', 0):,} total, {results.get('n_trainable', 0):,} trainable",
    ]
    if losses:
        lines.append(f"- loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    if tps:
        lines.append(f"- throughput: median {sorted(tps)[len(tps) // 2]:.0f} tokens/s")
    if results.get("first_step_seconds") is not None:
        lines.append(f"- first optimizer step {results['first_step_seconds']:.1f} s after start; "
                     f"wall {results.get('wall_seconds', 0):.0f} s")
    acc = _acc_rows(results)
    if acc:
        lines += ["", "| eval | before | after |", "|---|---|---|", *acc]
    samples = (results.get("eval_end") or {}).get("samples") or {}
    for task, items in samples.items():
        lines += ["", f"Samples ({task}, after training):", ""]
        lines += [f"- `{s['prompt']}` -> `{s['completion']}` ({'ok' if s['correct'] else 'expected ' + s['answer']})"
                  for s in items]
    if results.get("export"):
        lines += ["", "Export:", "", "```", json.dumps(results["export"], indent=1), "```"]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    slim = {k: v for k, v in results.items() if k != "losses"}
    (run_dir / "results.json").write_text(json.dumps({**slim, "losses": losses}, indent=1, default=str))
