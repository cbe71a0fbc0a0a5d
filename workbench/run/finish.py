"""What a run writes about itself: the manifest before the first step, the plan check after
`plan.check_after_steps`, and after the last step the export and the report.

    write_manifest(run, run_dir, ...)       # rank 0: manifest.json, config.yaml
    plan_check(run, state, tracker, ...)    # collective (the peak over ranks); the check on rank 0
    export_and_report(run, run_dir, ...)    # collective under sharding (the gathered weights)
    summary(run_dir, cfg, ...)              # the lines a run ends with

Each takes what it reads, by name. Secrets are redacted on the way to disk
(workbench/core/secrets.py).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from workbench.checkpoints.keep_best import metric_name
from workbench.core import heartbeat
from workbench.core.errors import UserError
from workbench.core.secrets import redact
from workbench.evals import stats
from workbench.export import llama_cpp
from workbench.export.write import export
from workbench.models.load import locate
from workbench.plan import check
from workbench.plan.make import make_plan
from workbench.telemetry import manifest, report, stall
from workbench.train import signal
from workbench.train.distributed import all_max


def write_manifest(run, run_dir: Path, *, data: dict, contract, resumed: str | None, resume: dict | None,
                   secrets) -> None:
    """manifest.json and config.yaml: the config, the model, the data's report (`data`), the chat
    contract, what the choices resolved to, and where the run resumed (`resume`: the checkpoint,
    its certificate, the batch kept)."""
    cfg = run.cfg
    man = manifest.build(OmegaConf.to_container(cfg, resolve=True),
                         {"kind": locate(cfg.model).kind, "name": cfg.model.name}, data, contract)
    man["resolved"] = run.summary()  # what the config's choices became here (precision=auto, peft, layout)
    man["resumed_from"] = resumed
    if resume:
        man["resume"] = resume  # from, the certificate (workbench/checkpoints/replay.py), the batch kept
    man["world_size"] = run.layout.world
    man = redact(man, secrets)  # config.yaml below is man["config"]: one redaction for both files
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "manifest.json").write_text(json.dumps(man, indent=1, default=str))
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(man["config"])))


def plan_check(run, run_dir: Path, step: int, tracker, memory: check.Memory, shapes: check.Shapes) -> dict | None:
    """Measured peak memory, step time and tokens/s against the planner's prediction for this
    run (workbench/plan/check.py); the peak is the largest over ranks (collective).
    `memory` and `shapes`: what the loop measured of the steps so far."""
    peak = all_max(memory.peak_gib())
    if not run.layout.is_main:
        return None
    cfg = run.cfg
    measured = {"peak_gib": peak or None, **check.step_figures(tracker.rows, skip=memory.profiled)}
    # planned for the batches the run had (their longest row, the share of positions with a
    # loss), not for data.seq_len's worst case
    here = _planned(run, shapes)
    at_peak = _planned(run, memory.planned_shapes(shapes))
    tokens_per_step = statistics.median(row["tokens"] for row in tracker.rows if "tokens" in row)
    tps = here.get("tokens_per_s")
    predicted = {"peak_gib": at_peak["peak_gb"], "step_seconds": tokens_per_step / tps if tps else None,
                 "tokens_per_s": tps}
    out = check.compare(predicted, measured)
    if cfg.plan.calibrate:
        out["stored"] = check.store(cfg.hardware, run.precision.name, cfg.model.name, out, run_dir)
    resident = check.resident_gib()
    tracker.console(check.line(out, step, check.resident_note(resident, peak, memory.device)))
    return {"steps": step, **out, "resident_gib": resident}


def _planned(run, shapes: check.Shapes) -> dict:
    return make_plan(shapes.config(run.cfg, run.facts.generates), others=False, calibrated=False,
                     rollout=shapes.rollout(), completion_len=shapes.completion_len())["here"]


def export_and_report(run, run_dir: Path, results: dict, *, backend, tokenizer, contract, checkpoints, tracker,
                      secrets) -> None:
    """train.export: the trained (or best, from `checkpoints`) weights of `backend` exported with
    the parity gate; rank 0 writes report.md and results.json, then every rank meets. A failed
    parity gate raises after the report, which shows the numbers."""
    cfg, is_main = run.cfg, run.layout.is_main
    if cfg.train.export and cfg.train.export_best:
        results["exported_from"] = checkpoints.load_best()
    with heartbeat.phase("export"):
        trained = backend.gathered_model() if cfg.train.export else None  # collective under sharding
        if is_main and cfg.train.export:
            t0 = time.time()
            tracker.console(export_line(run, run_dir))  # minutes without a step line: say what runs
            results["export"] = export(trained, tokenizer, contract, run, run_dir / "export", results)
            tracker.console(f"export: done in {time.time() - t0:.0f} s")
    if results.get("started"):  # the whole job: conversion, training, evaluation, export, parity
        results["wall_seconds"] = time.time() - results["started"]
    if is_main:
        # results copy eval prompts and samples, which may quote a token: redacted on the way to disk
        report.write(run_dir, run, redact(results, secrets), tracker.rows)
        tracker.finish(run_dir / "plots")  # plots to the trackers; close them
    if dist.is_initialized():
        dist.barrier()
    failed = (results.get("export") or {}).get("failed")
    if failed and not cfg.export.allow_mismatch:
        raise UserError(f"export: the parity gate failed for {', '.join(failed)} (see {run_dir}/report.md "
                        "and results.json); the files are kept; export.allow_mismatch=true accepts them")


def export_line(run, run_dir: Path) -> str:
    """What the export is about to write and check, said before it starts (it prints nothing
    until done: minutes for a GGUF read back by transformers and llama.cpp)."""
    cfg = run.cfg
    parts = ["adapter"] if run.peft.adapter else []
    if cfg.train.export_merged:
        parts.append("merged safetensors")
        parts += [f"GGUF {kind}" for kind in cfg.export.gguf]
    gate = (f", then the parity gate on {cfg.export.parity_prompts} prompts (each file read back and compared "
            "with the trained model)" if cfg.train.export_merged and not run.facts.scalar_head else "")
    return f"export: writing {', '.join(parts) or 'the model'} to {run_dir / 'export'}{gate}"


def summary(run_dir: Path, cfg, step: int, first: int, rows: list[dict], results: dict) -> list[str]:
    """The lines a run ends with on rank 0: what was trained, how it scored, where everything is.

        done: 150 steps (step 0 -> 150) in 3.1 min; loss 2.412 -> 0.318  [; 148 of 150 steps had reward spread]
        eval arith_add2/accuracy 0.000 -> 0.920 [0.874, 0.950] (200 questions)
        run directory: runs/2026-12-03_10-14-44 (report.md, results.json, metrics.jsonl)
        export: runs/2026-12-03_10-14-44/export/merged (parity passed), .../export/adapter

    `step`: the last step trained, `first`: the step the run started or resumed from, `rows`:
    the run's metrics rows.
    """
    losses = results.get("losses") or []
    wall = results.get("wall_seconds") or 0.0
    lines = [f"done: {step - first} steps (step {first} -> {step}) in {wall / 60:.1f} min"
             + (f"; loss {losses[0]:.4g} -> {losses[-1]:.4g}" if losses else "")]
    spread = signal.steps_with_signal(rows)  # GRPO family: a step without spread has no gradient
    if spread:
        lines[0] += f"; {spread[0]} of {spread[1]} steps had reward spread"
    start, end = results.get("eval_start") or {}, results.get("eval_end") or {}
    intervals = stats.intervals(end)  # the binomial 95% interval beside each accuracy
    for key, value in end.items():
        if key.startswith("eval/") and key.endswith(("/accuracy", "/loss", "/reward")) and isinstance(value, float):
            before = start.get(key)
            ci = intervals.get(f"{key}_ci95")
            n = end.get(key.rsplit("/", 1)[0] + "/n")
            lines.append(f"eval {metric_name(key)} " + (f"{before:.3f} -> " if isinstance(before, float) else "")
                         + f"{value:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
                         + (f" ({n} questions)" if n else ""))
    if results.get("stalled"):
        lines.append(f"stopped early at step {results['stalled']['step']}: {results['stalled']['reason']}")
    lines += stall.end_lines(results)  # a supervised loss that stopped falling, as warned mid-run
    lines.append(f"run directory: {run_dir} (report.md, results.json, metrics.jsonl)")
    exported = results.get("export") or {}
    paths = [str(exported[k]) for k in ("merged", "adapter", "reward_model") if exported.get(k)]
    paths += list(exported.get("gguf") or [])
    if paths:
        gate = (f"parity FAILED for {', '.join(exported['failed'])}" if exported.get("failed")
                else "parity passed" if exported.get("parity") else "")
        lines.append("export: " + ", ".join(paths) + (f" ({gate})" if gate else ""))
        lines += [llama_cpp.line(name, g["llama_cpp"]) for name, g in exported.get("parity", {}).items()
                  if "llama_cpp" in g]
    elif not cfg.train.export:
        lines.append(f"export: none (train.export=false); later: python -m workbench.export {run_dir}")
    return lines
