"""The overrides the Megatron test modules share, and the default tier's Megatron runs, which share
one torchrun job (tests/distributed/conftest.py `megatron_default`) so the tier pays for one
process start, import and process group.

    from tests.distributed.megatron_cases import LORA, METHODS, method_overrides
"""

from __future__ import annotations

# LoRA SFT with plain SGD: a weight's error stays proportional to its gradients' (tests/helpers.py
# sgd_weight_bound); the adapters' B start at zero, so a wrong shard, scale or reduction moves
# them by their own size from the first step on.
LORA = ["peft=lora", "peft.r=4", "peft.alpha=8", "optim.name=sgd", "optim.lr=0.5", "train.max_steps=3",
        "train.micro_batch_size=2", "train.grad_accum=2", "++hardware.timeout_minutes=8"]
# the methods: plain SGD, 3 steps, at tp=2 (2 ranks: dp=1, the same global batch as single's)
SGD = ["optim.name=sgd", "optim.lr=0.2", "train.max_steps=3", "train.micro_batch_size=2",
       "++hardware.timeout_minutes=8"]
TP2 = ["backend=megatron", "backend.tp=2", "train.grad_accum=2"]
METHODS = {
    "distill": ["method=distill", "method.lmbda=0.0", "peft=none"],
    "rm": ["method=rm", "peft=lora"],
    "kto": ["method=kto", "peft=lora"],
    "cpo": ["method=cpo", "peft=none"],
    "simpo": ["method=simpo", "peft=lora"],
    "orpo": ["method=orpo", "peft=lora"],
    "dpo": ["method=dpo", "peft=lora", "method.reference=precomputed"],
}
FAST = ("distill",)  # in the default tier
# the distributed optimizer: AdamW (the only one it steps), unclipped, at dp=2 (2 ranks)
ADAMW = ["peft=none", "optim.name=adamw", "optim.lr=1e-3", "optim.max_grad_norm=0", "train.max_steps=2",
         "train.micro_batch_size=2", "++hardware.timeout_minutes=8"]
DP2 = ["backend=megatron", "backend.distributed_optimizer=true", "train.grad_accum=1"]


def method_overrides(name: str, teacher) -> list[str]:
    return [*METHODS[name], *SGD] + ([f"method.teacher={teacher}"] if name == "distill" else [])


def default_runs(teacher) -> list[dict]:
    """LoRA at tp=2 with its export, distillation at tp=2, the distributed optimizer and a torch
    AdamW at dp=2: the default tier's Megatron runs."""
    return [{"name": "lora-tp2", "overrides": [*LORA, "backend=megatron", "backend.tp=2", "train.export=true"],
             "save_trainable": True},
            *({"name": n, "overrides": [*method_overrides(n, teacher), *TP2], "save_trainable": True} for n in FAST),
            {"name": "dp2-distopt", "overrides": [*ADAMW, *DP2], "save_trainable": True},
            {"name": "dp2-torch", "overrides": [*ADAMW, *DP2, "backend.distributed_optimizer=false"],
             "save_trainable": True}]
