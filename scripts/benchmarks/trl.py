"""workbench vs TRL's SFTTrainer on the embedded task (SmolLM2-135M, LoRA, CPU).

    python scripts/bench.py trl [--steps 6] [--model smollm2-135m]
    python scripts/bench.py trl --no-defaults --launches 0   # the same-settings ratio only

Three trainers see the same 2-digit-addition chat examples, batch 16:
  workbench        LoRA r=16 all-linear, lr 2e-4, --precision, loss on the answer only
  trl_same         TRL SFTTrainer with the same settings (prompt/completion data so the loss is
                   on the answer only; the same precision; no gradient checkpointing)
  trl_defaults     TRL SFTTrainer with its defaults (gradient checkpointing on, loss on every
                   token of the conversation) apart from batch 16, LoRA and CPU
--precision is `auto` by default: what a default run trains in on this CPU (bf16-mixed with
AMX or AVX512-BF16, else fp32; scripts/benchmarks/_common.py). They run in rounds, alternately,
in this one process, and the steady-state seconds per step (first step of each round dropped)
are compared as ratios. Also measured: seconds from
process launch to the first optimizer step of `python -m workbench` with a warm cache (median of
`--launches`, scripts/benchmarks/startup.py), and the
workbench's achieved FLOP/s (each step's training FLOPs counted as computed, workbench/compute/flops.py,
over its time: the `flops` of metrics.jsonl) against the peak the run's MFU uses (the bf16 matmul
peak of this machine: best of several trials, workbench/telemetry/metrics.py) and against a bf16 matmul
measured again at the end of this run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import add_common_args, resolve_precision
from benchmarks.startup import median_launch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data_recipes" / "data" / "arith_add2_train.jsonl"


def _rows(n: int) -> list[dict]:
    rows = [json.loads(line) for line in DATA.open()]
    return rows[:n]


def workbench_steps(steps: int, model: str, out: Path, precision: str = "bf16-mixed") -> list[dict]:
    """Metrics rows of a workbench run (each with its step's `flops` and `mfu`)."""
    from hydra import compose, initialize_config_dir

    from workbench.resolve.validate import validate
    from workbench.run.runner import Runner

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", f"precision={precision}", "eval=none", "train.export=false",
                                          f"train.max_steps={steps}", "train.resume=never", f"output_dir={out}"])
    runner = Runner(validate(cfg))
    res = runner.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "eval" not in r]  # training steps only
    assert len(rows) == steps and res["losses"]
    return rows


def trl_steps(steps: int, model_dir: str, same: bool, out: Path, bf16: bool = True) -> list[float]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.eos_token = "<|im_end|>"
    rows = _rows(16 * steps)
    if same:
        data = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
        args = SFTConfig(output_dir=str(out), use_cpu=True, bf16=bf16, per_device_train_batch_size=16,
                         max_steps=steps, learning_rate=2e-4, gradient_checkpointing=False, report_to=[],
                         logging_steps=1000, save_strategy="no", lr_scheduler_type="cosine", warmup_steps=5,
                         dataloader_num_workers=0)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    else:
        data = Dataset.from_list(rows)
        args = SFTConfig(output_dir=str(out), use_cpu=True, per_device_train_batch_size=16, max_steps=steps,
                         report_to=[], save_strategy="no", logging_steps=1000)
        lora = LoraConfig(task_type="CAUSAL_LM")
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, peft_config=lora,
                         callbacks=[Timer()])
    trainer.train()
    return times


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser()
    add_common_args(ap)  # workbench and trl_same alike (trl_defaults keeps TRL's own)
    ap.add_argument("--launches", type=int, default=5, help="warm launches timed to the first optimizer step; 0: none")
    # TRL's defaults train in bf16 autocast, which on a CPU without native bf16 (AVX2 only) runs
    # minutes per step: this leaves that side out and keeps the same-settings ratio
    ap.add_argument("--no-defaults", action="store_true", help="skip the trl_defaults side")
    args = ap.parse_args(argv)
    args.precision = resolve_precision(args.precision)
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    from workbench.models.load import converted_dir, locate, materialise, zoo_entry

    entry = zoo_entry(args.model)
    model_dir = materialise(entry, locate(entry)).path
    per: dict[str, list[float]] = {"workbench": [], "trl_same": []}
    if not args.no_defaults:
        per["trl_defaults"] = []
    achieved, mfu = [], []  # workbench FLOP/s and MFU per steady-state step
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            rows = workbench_steps(args.steps, args.model, tmp / f"wb{r}", args.precision)
            per["workbench"] += [row["step_seconds"] for row in rows[1:]]
            achieved += [row["flops"] / row["step_seconds"] for row in rows[1:]]
            mfu += [row["mfu"] for row in rows[1:]]
            per["trl_same"] += trl_steps(args.steps, model_dir, True, tmp / f"ts{r}", args.precision != "fp32")[1:]
            if not args.no_defaults:
                per["trl_defaults"] += trl_steps(args.steps, model_dir, False, tmp / f"td{r}")[1:]
    launch = median_launch(args.launches, [f"model={args.model}"]) if args.launches else None  # benchmarks/startup.py
    import torch

    from workbench.compute.precision import spec
    from workbench.plan.peak import matmul_flops, measured_peak_flops

    peak = measured_peak_flops("cpu", spec("bf16-mixed"))  # the peak bf16-mixed runs' MFU is taken against
    now = matmul_flops("cpu", torch.bfloat16)  # and one measured now, after the runs
    med = {k: statistics.median(v) for k, v in per.items()}
    return {
        "model": args.model, "precision": args.precision, "steps_per_round": args.steps, "rounds": args.rounds,
        "model_dir": str(converted_dir(args.model)),
        "median_seconds_per_step": med,
        "ratio_throughput_vs_trl_same": med["trl_same"] / med["workbench"],
        "ratio_throughput_vs_trl_defaults": med["trl_defaults"] / med["workbench"] if "trl_defaults" in med else None,
        "first_optimizer_step_seconds_after_launch": launch["median_seconds"] if launch else None, "launch": launch,
        "workbench_achieved_flops": statistics.median(achieved), "bf16_matmul_peak_flops": peak,
        "bf16_matmul_flops_measured_now": now, "workbench_mfu_logged": statistics.median(mfu),
        "achieved_over_bf16_matmul": statistics.median(achieved) / max(peak, now),
        "threads": torch.get_num_threads(),
    }
