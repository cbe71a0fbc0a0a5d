"""Learning outcome of the long-context task (workbench/data/needle.py) on SmolLM2-135M (slow:
about half an hour of CPU).

    OMP_NUM_THREADS=2 .venv/bin/python -m pytest -q -m slow tests/integration/test_learning_long_context.py -s
    python scripts/method_seeds.py needle needle_base --seeds 0 1 2       # the README's rows

A station log of 1,600-3,300 tokens states six 4-digit access codes once each; the question at
the end asks for one. LoRA SFT on the 200 training logs (`data_recipes/needle_sft.yaml`), 60
steps of one log each, `precision=bf16-mixed` (the precision measured; pinned, not `auto`), `model.loss_chunk=512`;
exact match on the first EVAL_N logs of the test split, whose stations no training log names.

What the base model does (`needle_base`, greedy, 24 new tokens so a sentence can finish): it
never answers with the code alone (exact match 0), and the right code appears somewhere in its
answer (`found`) on MEASURED["base_found"] of the test logs: it copies a code from the log but
often the wrong station's. So the bar is set above what a model that only learned the answer's
format would score (the base's `found`), not above 0: see BAR.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import train

EVAL_N = 100  # test logs evaluated (greedy, one at a time: ~8 s each on one core at these lengths)
NEEDLE = ["model=smollm2-135m", "method=lora", "data.recipe=needle_sft", "data.seq_len=4096",
          "train.micro_batch_size=1", "train.max_steps=60", "train.log_every=5", "model.loss_chunk=512",
          "eval=arith", "eval.tasks=[needle]", f"eval.num_samples={EVAL_N}", "eval.batch_size=1",
          "train.export=false", "train.resume=never", "precision=bf16-mixed"]
ACCURACY, FOUND = "eval/needle/accuracy", "eval/needle/found"

# Measured (scripts/method_seeds.py needle needle_base --seeds 0 1 2; docs/measurements/learning.md)
# 2-core AMD EPYC (AVX512-BF16), one thread per run: base 0.00 exact, 0.35 found; after 60 steps
# seeds 0, 1, 2: 0.55, 0.56, 0.62. The bar is two standard deviations of an accuracy over 100 logs
# at seed 0's 0.55 (0.05 each) below it: 0.45, above the base's found (0.35), so a model that only
# learned to answer with the bare code, finding it as often as the base does, fails.
MEASURED = {"base_accuracy": 0.0, "base_found": 0.35, "after": 0.55}
BAR = 0.45


def needle(seed: int, out: Path) -> dict:
    """The 60-step LoRA SFT of one seed; its results (eval_end: exact match and found on the test logs)."""
    return train([*NEEDLE, f"train.seed={seed}", f"data.shuffle_seed={seed}", "eval.at_start=false",
                  "eval.at_end=true"], out, base=[])


def needle_base(out: Path) -> dict:
    """The base model on the same test logs, no training (greedy: the same at every seed), with
    24 new tokens so that an answer given as a sentence is complete and `found` can count it."""
    return train([*NEEDLE, "train.max_steps=0", "eval.at_start=true", "eval.at_end=false",
                  "eval.max_new_tokens=24"], out, base=[])


@pytest.mark.slow
def test_short_fine_tune_finds_the_code(tmp_path):
    res = needle(0, tmp_path)
    after = res["eval_end"][ACCURACY]
    print(f"\nneedle exact match after 60 steps {after:.3f} (measured {MEASURED}, bar {BAR})")
    assert after >= BAR, f"{after:.3f}: below the bar {BAR} (measured {MEASURED})"
