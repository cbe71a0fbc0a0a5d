"""Backends: how the model is wrapped, stepped and saved. Each module defines `Config` and
`build(cfg, ctx)`. CHOICES maps `backend.name` to the module; `conf/backend/<name>.yaml`
selects it.
"""

CHOICES = {"single": "single", "fsdp2": "fsdp2", "deepspeed": "deepspeed", "megatron": "megatron"}
