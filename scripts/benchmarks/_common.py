"""Helpers shared by the side-by-side benchmarks (scripts/benchmarks/dpo.py, grpo.py).

Not a benchmark itself (bench.py skips names starting with "_"). What they share:
  model_dir(name)           the packaged model as an HF directory, for TRL (no hub download)
  workbench_rows(ov, out)   the per-step metrics rows of an in-process `python -m workbench` run
  StepTimer                 a TrainerCallback timing each TRL optimizer step
  alternate(rounds, sides)  run every side once per round, in turn, keeping steps after the first
  summary(per)              median seconds per step of each side
  add_common_args(ap)       --steps, --rounds, --model and --precision (`auto`: as a default run here)
  trl_args(cls, ...)        a TRL trainer's arguments with the settings every benchmark shares
  trl_lora(task)            the LoRA every benchmark trains (r=16, alpha=32, every linear layer)
  reward_model()            SmolLM2 with a random scalar head, its tokenizer and chat contract
  reward_classifier()       the same as a transformers sequence classifier (what method=rm exports)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data_recipes" / "data"


def model_dir(model: str) -> str:
    """The packaged model converted to an HF directory in the workbench cache (offline)."""
    os.environ.setdefault("WORKBENCH_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from workbench.models.load import locate, materialise, zoo_entry

    entry = zoo_entry(model)
    return str(materialise(entry, locate(entry)).path)


def jsonl(name: str, n: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (DATA / name).open()]
    return rows if n is None else rows[:n]


def compose(overrides: list[str], out: Path):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from workbench.resolve.validate import validate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = hydra_compose("train", overrides=[*overrides, "eval=none", "train.export=false", "train.resume=never",
                                                f"output_dir={out}"])
    return validate(cfg)


def workbench_rows(overrides: list[str], out: Path) -> list[dict]:
    """Metrics rows (training steps only) of an in-process workbench run."""
    from workbench.run.runner import Runner

    Runner(compose(overrides, out)).train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval" not in r]


def step_timer(times: list[float]):
    """A TrainerCallback appending each optimizer step's wall seconds to `times` (the step
    includes everything the trainer does for it: TRL's GRPO generates inside the step)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

    return StepTimer()


def alternate(rounds: int, sides: dict[str, Callable[[int], list[float]]]) -> dict[str, list[float]]:
    """Each side runs once per round, in turn, in this process; the first step of every run
    (compilation, allocator and cache warm-up) is dropped. Alternating spreads the load other
    processes put on a shared machine over both sides instead of onto whichever ran second."""
    per: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(rounds):
        for name, fn in sides.items():
            per[name] += fn(r)[1:]
    return per


def summary(per: dict[str, list[float]]) -> dict[str, float]:
    """Median seconds per step of each side (NaN when a side kept no steps: --steps 1)."""
    return {k: statistics.median(v) if v else float("nan") for k, v in per.items()}


def trl_tokenizer(path: str):
    """The model's tokenizer with its end-of-turn as EOS, as the workbench's contract uses it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = "<|im_end|>"
    return tok


def add_common_args(ap) -> None:
    """The options every side-by-side benchmark takes. `--precision` applies to both sides; `auto`
    (the default) resolves as the workbench's `precision=auto` does on this CPU
    (workbench/compute/precision.py `choose`): bf16-mixed with AMX or AVX512-BF16, else fp32, so each side
    runs as a default run on this machine would; the result's `precision` names what was resolved."""
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16-mixed"], default="auto")


def resolve_precision(name: str) -> str:
    if name != "auto":
        return name
    from workbench.compute.precision import choose

    return choose("cpu")[0]


def trl_args(config_cls, out: Path, precision: str, batch: int, steps: int, accum: int = 1, **options):
    """`config_cls` (a TRL trainer's config) with the settings the workbench side also runs: CPU,
    `precision`, micro-batches of `batch` (`accum` of them a step), AdamW lr 2e-4 with warmup 5
    then cosine, no weight decay, gradient clipping 1.0, no gradient checkpointing, and no
    logging, saving or data-loader workers to time besides the steps."""
    return config_cls(output_dir=str(out), use_cpu=True, bf16=precision == "bf16-mixed", fp16=False,
                      per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=steps,
                      learning_rate=2e-4, lr_scheduler_type="cosine", warmup_steps=5, weight_decay=0.0,
                      max_grad_norm=1.0, gradient_checkpointing=False, report_to=[], logging_steps=1000,
                      save_strategy="no", dataloader_num_workers=0, **options)


def trl_lora(task: str = "CAUSAL_LM"):
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type=task)


def reward_model():
    """(model, tokenizer, contract): the packaged SmolLM2 with a scalar head (what method=rm
    trains), its head drawn from normal(0, 0.05) under seed 0 so that rewards differ, fp32."""
    import tempfile

    import torch

    from workbench.data.chat import setup_tokenizer
    from workbench.models import value_head
    from workbench.models.load import load_model, load_tokenizer

    model_dir("smollm2-135m")  # converted once, offline
    with tempfile.TemporaryDirectory() as tmp:
        cfg = compose(["method=rm", "peft=none"], Path(tmp))
    tok = load_tokenizer(cfg.model)
    model = value_head.attach(load_model(cfg.model))
    torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)
    return model, tok, setup_tokenizer(tok)


def reward_classifier():
    """(classifier, tokenizer, contract): reward_model() as the *ForSequenceClassification a
    method=rm export is."""
    import torch

    from workbench.models import value_head

    lm, tok, contract = reward_model()
    return value_head.to_sequence_classifier(lm, lm.lm_head.weight, tok.pad_token_id, torch.float32), tok, contract
