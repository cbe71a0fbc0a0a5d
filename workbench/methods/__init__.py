"""Training methods. Each module defines `Config` (its options) and `build(cfg, ctx)`.

CHOICES maps `method.name` to the module; `conf/method/<name>.yaml` selects it.
"""

CHOICES = {
    "sft": "sft",
    "dpo": "dpo",
    "kto": "kto",
    "cpo": "cpo",  # conf/method/simpo.yaml: cpo with loss_type=simpo
    "orpo": "orpo",
    "rm": "rm",
    "grpo": "grpo",  # conf/method/gspo.yaml, rloo.yaml: grpo with those options
    "distill": "distill",
}
