"""The one list of training methods: name -> MethodSpec (workbench/methods/spec.py).

    from workbench.methods import registry
    registry.spec("grpo").facts.generates       # True
    registry.spec("grpo").build(cfg.method, ctx)

`conf/method/<name>.yaml` selects a method by `method.name`; aliases (`lora`, `qlora`, `simpo`,
`gspo`, `rloo`) are YAML files that compose a registered method with other options
(tests/unit/test_config.py holds conf/method/ and this table to each other). An unknown name is
a UserError listing the choices, never another method's facts.
"""

from __future__ import annotations

from workbench.core.errors import UserError
from workbench.methods import cpo, distill, dpo, grpo, kto, orpo, rm, sft
from workbench.methods.spec import MethodSpec

SPECS: dict[str, MethodSpec] = {s.name: s for s in (sft.SPEC, dpo.SPEC, kto.SPEC, cpo.SPEC, orpo.SPEC, rm.SPEC,
                                                   grpo.SPEC, distill.SPEC)}


def spec(name: str | None) -> MethodSpec:
    """The spec of `method.name`; a UserError naming the choices for anything else."""
    if name not in SPECS:
        raise UserError(f"method.name={name!r} is not one of {sorted(SPECS)}")
    return SPECS[name]
