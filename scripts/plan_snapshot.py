"""The planner's JSON for a fixed set of configs, to compare the plan before and after a change
to the planner or to a spec it reads.

    python scripts/plan_snapshot.py /tmp/before      # one <name>.json per config
    (change the code)
    python scripts/plan_snapshot.py /tmp/after --diff /tmp/before   # exit 1 where a plan differs

Each config is composed as the command line composes it and validated, then planned with
`make_plan(cfg, calibrated=False)` (no earlier run's ratios, which depend on this machine's runs
directory). The configs span every method family the planner treats differently (SFT, a
reference model, a teacher, a scalar head, rollouts sync and async, vLLM), every backend, peft
kinds and hardware profiles. `grpo-method-defaults` removes max_new_tokens and share_prompt from
the method node, so they come from the method's own `Config`; `grpo-unvalidated` plans that
config without validation, as the planner's own changed configs are planned.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "default": [],
    "dpo-70b": ["model=70b", "method=dpo"],
    "dpo-70b-fsdp2-8xh100": ["model=70b", "method=dpo", "backend=fsdp2", "hardware=8xh100"],
    "qlora-8b": ["model=8b", "method=qlora"],
    "kto-qwen-zero3": ["model=qwen2.5-7b", "method=kto", "backend=deepspeed", "backend.stage=3", "hardware=8xh100"],
    "sft-70b-megatron": ["model=70b", "backend=megatron", "backend.tp=8", "hardware=8xh100"],
    "lora-mixtral-8xb200": ["model=mixtral-8x22b", "method=lora", "hardware=8xb200"],
    "distill": ["method=distill"],
    "rm": ["method=rm"],
    "grpo-8b": ["model=8b", "method=grpo", "hardware=h100-80gb"],
    "grpo-8b-vllm-async": ["model=8b", "method=grpo", "hardware=h100-80gb", "method.engine=vllm",
                           "method.async_rollouts=true", "method.num_iterations=2"],
    "rloo": ["method=rloo"],
    "grpo-method-defaults": ["method=grpo", "~method.max_new_tokens", "~method.share_prompt"],
}
UNVALIDATED = {"grpo-unvalidated": CONFIGS["grpo-method-defaults"]}


def plans() -> dict[str, dict]:
    from workbench.config.schema import register_resolvers
    from workbench.plan.make import make_plan
    from workbench.resolve.validate import validate

    register_resolvers()
    out = {}
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name, overrides in {**CONFIGS, **UNVALIDATED}.items():
            cfg = compose(config_name="train", overrides=overrides)
            out[name] = make_plan(cfg if name in UNVALIDATED else validate(cfg), calibrated=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--diff", type=Path, help="a directory an earlier run wrote; exit 1 where a plan differs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    differ = []
    for name, plan in plans().items():
        text = json.dumps(plan, indent=1, sort_keys=True, default=float)
        (args.out / f"{name}.json").write_text(text + "\n")
        if args.diff:
            before = args.diff / f"{name}.json"
            if not before.exists() or before.read_text() != text + "\n":
                differ.append(name)
    if args.diff:
        print("plans that differ: " + (", ".join(differ) or "none"))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
