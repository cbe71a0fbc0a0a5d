"""The one list of backends: `backend.name` -> BackendSpec (workbench/backends/spec.py).

    from workbench.backends import registry
    registry.spec("fsdp2").build(cfg.backend, ctx)

`conf/backend/<name>.yaml` selects one. The modules import their engines (deepspeed,
megatron-core) inside the functions that use them, so listing a backend here imports no
optional package.
"""

from __future__ import annotations

from workbench.backends import deepspeed, fsdp2, megatron, single
from workbench.backends.spec import BackendSpec
from workbench.core.errors import UserError

SPECS: dict[str, BackendSpec] = {m.SPEC.name: m.SPEC for m in (single, fsdp2, deepspeed, megatron)}


def spec(name: str | None) -> BackendSpec:
    if name not in SPECS:
        raise UserError(f"backend.name={name!r} is not one of {sorted(SPECS)}")
    return SPECS[name]
