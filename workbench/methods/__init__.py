"""Training methods. Each module defines `Config` (its options) and `build(cfg, ctx)`.

CHOICES maps `method.name` to the module; `conf/method/<name>.yaml` selects it.
"""

CHOICES = {"sft": "sft", "dpo": "dpo", "grpo": "grpo"}
