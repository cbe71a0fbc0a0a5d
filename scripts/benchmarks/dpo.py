"""workbench method=dpo vs TRL's DPOTrainer (SmolLM2-135M, CPU): seconds per step, as ratios.

    python scripts/bench.py dpo                                   # 6 steps x 2 rounds, precision auto
    python scripts/bench.py dpo --steps 2 --rounds 1              # smoke test
    python scripts/bench.py dpo --precision fp32                  # or bf16-mixed: both sides alike
    python scripts/bench.py dpo --only lora                       # one of: lora, full

Both sides train on the same preference pairs (data_recipes/data/arith_dpo_train.jsonl), 16
pairs per optimizer step (one micro-batch), sigmoid loss with beta 0.1, AdamW lr 2e-4 with
warmup 5 then cosine, gradient clipping 1.0, no gradient checkpointing, two settings:
  lora   LoRA r=16 alpha=32 on every linear layer; the reference is the model with its adapters
         disabled (workbench method.reference=adapter; TRL's default with a PEFT model)
  full   full fine-tuning (workbench peft=none); the reference is a frozen copy of the initial
         model (workbench method.reference=copy; TRL: ref_model = a copy of the model)
Each pair is drawn by each side's own shuffle, so individual steps see different lengths; the
medians over steps compare the same distribution.

Precision: `auto` by default, resolved as a default workbench run resolves it on this CPU
(scripts/benchmarks/_common.py): bf16-mixed with AMX or AVX512-BF16 (both sides under bf16
autocast; TRL: bf16=True), fp32 elsewhere, where bf16 is emulated with conversions around fp32
arithmetic and slower than fp32. `--precision` names one for both sides.

The sides run alternately in rounds in this one process; the first step of every run is dropped
(warm-up). Reported: median s/step per side and setting, and workbench throughput / TRL
throughput (= TRL s/step / workbench s/step; > 1 means the workbench is faster).
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

from benchmarks._common import (
    add_common_args,
    alternate,
    jsonl,
    model_dir,
    resolve_precision,
    step_timer,
    summary,
    trl_args,
    trl_lora,
    trl_tokenizer,
    workbench_rows,
)

PAIRS_PER_STEP = 16
SETTINGS = {"lora": ["peft=lora", "method.reference=adapter"], "full": ["peft=none", "method.reference=copy"]}


def workbench_times(setting: str, steps: int, model: str, precision: str, out: Path) -> list[float]:
    rows = workbench_rows([f"model={model}", "method=dpo", *SETTINGS[setting], f"precision={precision}",
                           f"train.micro_batch_size={PAIRS_PER_STEP}", "train.grad_accum=1",
                           f"train.max_steps={steps}"], out)
    assert len(rows) == steps, f"workbench ran {len(rows)} steps, expected {steps}"
    return [r["step_seconds"] for r in rows]


def trl_times(setting: str, steps: int, path: str, precision: str, out: Path) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    rows = jsonl("arith_dpo_train.jsonl")
    data = Dataset.from_list([{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    args = trl_args(DPOConfig, out, precision, PAIRS_PER_STEP, steps, beta=0.1, loss_type=["sigmoid"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    times: list[float] = []
    kw = {}
    if setting == "lora":
        kw["peft_config"] = trl_lora()
    else:
        kw["ref_model"] = copy.deepcopy(model).eval()
    trainer = DPOTrainer(model=model, args=args, train_dataset=data, processing_class=trl_tokenizer(path),
                         callbacks=[step_timer(times)], **kw)
    trainer.train()
    assert len(times) == steps, f"TRL ran {len(times)} steps, expected {steps}"
    return times


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py dpo")
    add_common_args(ap)
    ap.add_argument("--only", choices=sorted(SETTINGS), default=None, help="run one setting only")
    args = ap.parse_args(argv)
    args.precision = resolve_precision(args.precision)
    import torch

    path = model_dir(args.model)
    settings = [args.only] if args.only else list(SETTINGS)
    result: dict = {"model": args.model, "precision": args.precision, "steps_per_round": args.steps,
                    "rounds": args.rounds, "pairs_per_step": PAIRS_PER_STEP, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for s in settings:
            sides = {
                "workbench": lambda r, s=s: workbench_times(s, args.steps, args.model, args.precision, tmp / f"wb_{s}{r}"),
                "trl": lambda r, s=s: trl_times(s, args.steps, path, args.precision, tmp / f"trl_{s}{r}"),
            }
            med = summary(alternate(args.rounds, sides))
            result[s] = {"median_seconds_per_step": med,
                         "ratio_throughput_workbench_over_trl": med["trl"] / med["workbench"]}
    return result
