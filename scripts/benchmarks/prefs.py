"""The preference methods beyond DPO against TRL's trainers (SmolLM2-135M, LoRA, CPU): s/step, as ratios.

    python scripts/bench.py prefs                                   # rm, kto, orpo, simpo; 6 steps x 2 rounds
    python scripts/bench.py prefs --only kto --steps 2 --rounds 1   # smoke test of one method
    python scripts/bench.py prefs --precision fp32                  # or bf16-mixed: both sides alike

Each method runs against TRL's own trainer for it, on the same preference pairs
(data_recipes/data/arith_dpo_train.jsonl), with the same settings: LoRA r=16 alpha=32 on every
linear layer, 16 pairs per optimizer step in one micro-batch (KTO: those pairs split into 32
unpaired rows, the chosen completion desirable and the rejected one undesirable), AdamW lr 2e-4
with warmup 5 then cosine, gradient clipping 1.0, no gradient checkpointing:
  rm     method=rm: scalar head, Bradley-Terry       RewardTrainer on AutoModelForSequenceClassification
  kto    method=kto, beta 0.1, reference = the model  KTOTrainer (the same reference, its KL point)
         with its adapters disabled
  orpo   method=orpo, beta 0.1                        trl.experimental.orpo.ORPOTrainer
  simpo  method=simpo: beta 2, gamma 1, no NLL        trl.experimental.cpo.CPOTrainer, loss_type simpo
The reference-free methods (rm, orpo, simpo) load no reference on either side. Each pair is drawn
by each side's own shuffle, so individual steps see different lengths; the medians over steps
compare the same distribution.

Precision: `auto` by default (what a default run trains in on this CPU; see
scripts/benchmarks/dpo.py). The sides run alternately in rounds in this one process; the first
step of every run is dropped. Reported per method: median s/step of each side and the
workbench's throughput over TRL's (TRL s/step / workbench s/step; > 1: the workbench is faster).
"""

from __future__ import annotations

import argparse
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
METHODS = ("rm", "kto", "orpo", "simpo")


def _rows_per_step(method: str) -> int:
    return 2 * PAIRS_PER_STEP if method == "kto" else PAIRS_PER_STEP  # KTO: a pair is two rows


def workbench_times(method: str, steps: int, model: str, precision: str, out: Path) -> list[float]:
    rows = workbench_rows([f"model={model}", f"method={method}", "peft=lora", f"precision={precision}",
                           f"train.micro_batch_size={_rows_per_step(method)}", "train.grad_accum=1",
                           f"train.max_steps={steps}"], out)
    assert len(rows) == steps, f"workbench ran {len(rows)} steps, expected {steps}"
    return [r["step_seconds"] for r in rows]


def _trl_data(method: str):
    from datasets import Dataset

    pairs = jsonl("arith_dpo_train.jsonl")
    if method == "kto":
        return Dataset.from_list([{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r[side]}],
                                   "label": side == "chosen"} for r in pairs for side in ("chosen", "rejected")])
    return Dataset.from_list([{"prompt": r["prompt"], "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in pairs])


def _trl_trainer(method: str):
    """(trainer class, config class, method options, model loader, peft task type) for one method."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if method == "rm":
        from trl import RewardConfig, RewardTrainer

        return RewardTrainer, RewardConfig, {}, (lambda p, **kw: AutoModelForSequenceClassification.from_pretrained(
            p, num_labels=1, **kw)), "SEQ_CLS"
    if method == "kto":
        from trl import KTOConfig, KTOTrainer

        return KTOTrainer, KTOConfig, {"beta": 0.1}, AutoModelForCausalLM.from_pretrained, "CAUSAL_LM"
    if method == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer, ORPOConfig, {"beta": 0.1}, AutoModelForCausalLM.from_pretrained, "CAUSAL_LM"
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    return (CPOTrainer, CPOConfig, {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 1.0},
            AutoModelForCausalLM.from_pretrained, "CAUSAL_LM")


def trl_times(method: str, steps: int, path: str, precision: str, out: Path) -> list[float]:
    import torch
    trainer_cls, config_cls, options, load, task = _trl_trainer(method)
    args = trl_args(config_cls, out, precision, _rows_per_step(method), steps, **options)
    tok = trl_tokenizer(path)
    if tok.pad_token is None:  # the pad the workbench gives this tokenizer (workbench/data/chat.py)
        tok.pad_token = "<|endoftext|>"
    model = load(path, dtype=torch.float32)
    if model.config.pad_token_id is None:  # the sequence-classification head finds each row's last token by it
        model.config.pad_token_id = tok.pad_token_id
    times: list[float] = []
    trainer = trainer_cls(model=model, args=args, train_dataset=_trl_data(method), processing_class=tok,
                          peft_config=trl_lora(task), callbacks=[step_timer(times)])
    trainer.train()
    assert len(times) == steps, f"TRL ran {len(times)} steps, expected {steps}"
    return times


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="bench.py prefs")
    add_common_args(ap)
    ap.add_argument("--only", choices=METHODS, action="append", help="run this method (repeatable); default all")
    args = ap.parse_args(argv)
    args.precision = resolve_precision(args.precision)
    import torch

    path = model_dir(args.model)
    result: dict = {"model": args.model, "precision": args.precision, "steps_per_round": args.steps,
                    "rounds": args.rounds, "pairs_per_step": PAIRS_PER_STEP, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for m in args.only or METHODS:
            sides = {
                "workbench": lambda r, m=m: workbench_times(m, args.steps, args.model, args.precision, tmp / f"wb_{m}{r}"),
                "trl": lambda r, m=m: trl_times(m, args.steps, path, args.precision, tmp / f"trl_{m}{r}"),
            }
            med = summary(alternate(args.rounds, sides))
            result[m] = {"median_seconds_per_step": med, "ratio_throughput_workbench_over_trl": med["trl"] / med["workbench"]}
    return result
