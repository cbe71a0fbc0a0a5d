"""The one list of backends: `backend.name` -> (options dataclass, builder).

    from workbench.backends import registry
    registry.spec("fsdp2").build(cfg.backend, ctx)

`conf/backend/<name>.yaml` selects one. The modules import their engines (deepspeed,
megatron-core) inside the functions that use them, so listing a backend here imports no
optional package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workbench.backends import deepspeed, fsdp2, megatron, single
from workbench.core.errors import UserError


@dataclass(frozen=True)
class BackendSpec:
    name: str
    config: type  # the options dataclass; conf/backend/<name>.yaml composes onto it
    build: Callable  # (backend config, Context) -> a Backend (workbench/backends/base.py)


SPECS: dict[str, BackendSpec] = {m.Config().name: BackendSpec(m.Config().name, m.Config, m.build)
                                 for m in (single, fsdp2, deepspeed, megatron)}


def spec(name: str | None) -> BackendSpec:
    if name not in SPECS:
        raise UserError(f"backend.name={name!r} is not one of {sorted(SPECS)}")
    return SPECS[name]
