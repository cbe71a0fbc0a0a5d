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

CHAR_LENGTH = 'reward.functions=["tests.rewards:char_length"]'
GRPO_SHAPE = ["method.num_generations=4", "method.dynamic_sampling=false", "train.grad_accum=1"]
# advantages divided by the group's std, as these curves were recorded (GRPO's default is now none)
STD_SCALED = "method.scale_rewards=group"

CASES: dict[str, list[str]] = {
    "sft_none": ["method=sft", "peft=none"],
    "sft_lora": ["method=sft", "peft=lora"],
    "sft_qlora": ["method=sft", "peft=qlora"],
    "dpo_none": ["method=dpo", "peft=none"],
    "dpo_lora": ["method=dpo", "peft=lora"],
    # a reward with spread on the random tiny model's text; KL and two passes per generation batch
    # the batch shape is pinned (4 completions of one prompt per step, no refills): these curves
    # check the loss arithmetic, not method=grpo's defaults, which were chosen by measurement
    "grpo_none": ["method=grpo", "peft=none", CHAR_LENGTH, STD_SCALED,
                  "method.beta=0.1", "method.num_iterations=2", "method.loss_type=grpo", *GRPO_SHAPE],
    "grpo_lora": ["method=grpo", "peft=lora", CHAR_LENGTH, STD_SCALED,
                  "method.beta=0.1", "method.num_iterations=2", *GRPO_SHAPE],
    "kto_none": ["method=kto", "peft=none"],
    "kto_lora": ["method=kto", "peft=lora"],
    "cpo_none": ["method=cpo", "peft=none"],
    "cpo_lora": ["method=cpo", "peft=lora"],
    "simpo_none": ["method=simpo", "peft=none"],
    "simpo_lora": ["method=simpo", "peft=lora"],
    "orpo_none": ["method=orpo", "peft=none"],
    "orpo_lora": ["method=orpo", "peft=lora"],
    "rm_none": ["method=rm", "peft=none"],
    "rm_lora": ["method=rm", "peft=lora"],
    # the policy-gradient variants, with GRPO's pinned shape and a KL term where the method has one
    "grpo_gspo_none": ["method=gspo", "peft=none", CHAR_LENGTH, STD_SCALED, "method.beta=0.1", "method.num_iterations=2",
                       *GRPO_SHAPE],
    "grpo_gspo_lora": ["method=gspo", "peft=lora", CHAR_LENGTH, STD_SCALED, "method.beta=0.1", "method.num_iterations=2",
                       *GRPO_SHAPE],
    "grpo_rloo_none": ["method=rloo", "peft=none", CHAR_LENGTH, "method.num_iterations=2", *GRPO_SHAPE],
    "grpo_rloo_lora": ["method=rloo", "peft=lora", CHAR_LENGTH, "method.num_iterations=2", *GRPO_SHAPE],
    "grpo_cispo_none": ["method=grpo", "peft=none", CHAR_LENGTH, STD_SCALED, "method.loss_type=cispo", "method.epsilon_high=5.0",
                        "method.beta=0.1", "method.num_iterations=2", *GRPO_SHAPE],
    "grpo_sapo_lora": ["method=grpo", "peft=lora", CHAR_LENGTH, STD_SCALED, "method.loss_type=sapo", "method.beta=0.1",
                       "method.num_iterations=2", *GRPO_SHAPE],
    # the teacher is the tiny model as conf/model/tiny.yaml builds it (seed 0), the student seed 1;
    # step 3 is on-policy (method.lmbda=0.5 under train.seed), so both data paths are pinned
    "distill_none": ["method=distill", "peft=none", "method.teacher=tiny", "model.init_seed=1"],
    "distill_lora": ["method=distill", "peft=lora", "method.teacher=tiny", "model.init_seed=1"],
}


def run_case(name: str, out_dir) -> list[float]:
    from tests.conftest import train

    results = train(CASES[name] + ["train.resume=never"], out_dir)
    return [float(x) for x in results["losses"]]


# Overrides as the stored files spell them -> as the cases spell them now. The reward function
# moved from tests/unit/test_rewards.py to tests/rewards.py with the same body, so the curves it
# produced stand and the files are not rewritten; scripts/update_golden.py writes the new name.
RENAMED = {"tests.unit.test_rewards:char_length": "tests.rewards:char_length"}


def _current(override: str) -> str:
    for old, new in RENAMED.items():
        override = override.replace(old, new)
    return override


def load(name: str) -> dict:
    data = json.loads((ASSETS / f"{name}.json").read_text())
    data["overrides"] = [_current(o) for o in data["overrides"]]
    return data


def write(name: str, losses: list[float]) -> Path:
    ASSETS.mkdir(parents=True, exist_ok=True)
    path = ASSETS / f"{name}.json"
    path.write_text(json.dumps({"case": name, "overrides": CASES[name], "losses": losses}, indent=1) + "\n")
    return path
