"""Golden loss curves: which runs are pinned, and how one is produced.

Each case is a list of overrides on top of the tiny fp32 baseline (tests/conftest.py TINY).
`scripts/update_golden.py [case ...]` rewrites tests/assets/losses/<case>.json; tests compare
against those files with rtol 1e-5. A change in a curve is a change in numerics: regenerate
with the script and say why in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets" / "losses"

GRPO_SHAPE = ["method.num_generations=4", "method.dynamic_sampling=false", "train.grad_accum=1"]

CASES: dict[str, list[str]] = {
    "sft_none": ["method=sft", "peft=none"],
    "sft_lora": ["method=sft", "peft=lora"],
    "sft_qlora": ["method=sft", "peft=qlora"],
    "dpo_none": ["method=dpo", "peft=none"],
    "dpo_lora": ["method=dpo", "peft=lora"],
    # a reward with spread on the random tiny model's text; KL and two passes per generation batch
    # the batch shape is pinned (4 completions of one prompt per step, no refills): these curves
    # check the loss arithmetic, not method=grpo's defaults, which were chosen by measurement
    "grpo_none": ["method=grpo", "peft=none", 'reward.functions=["tests.unit.test_rewards:char_length"]',
                  "method.beta=0.1", "method.num_iterations=2", "method.loss_type=grpo", *GRPO_SHAPE],
    "grpo_lora": ["method=grpo", "peft=lora", 'reward.functions=["tests.unit.test_rewards:char_length"]',
                  "method.beta=0.1", "method.num_iterations=2", *GRPO_SHAPE],
}


def run_case(name: str, out_dir) -> list[float]:
    from tests.conftest import train

    results = train(CASES[name] + ["train.resume=never"], out_dir)
    return [float(x) for x in results["losses"]]


def load(name: str) -> dict:
    return json.loads((ASSETS / f"{name}.json").read_text())


def write(name: str, losses: list[float]) -> Path:
    ASSETS.mkdir(parents=True, exist_ok=True)
    path = ASSETS / f"{name}.json"
    path.write_text(json.dumps({"case": name, "overrides": CASES[name], "losses": losses}, indent=1) + "\n")
    return path
