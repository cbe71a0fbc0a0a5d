"""What a peft kind is, decided once: `Peft(kind)` says whether the run trains adapters, whether
the base is quantised to 4 bits, whether the adapters are DoRA.

    Peft("qlora").adapter, Peft("qlora").quantised     # True, True

The resolved run carries one (workbench/resolve/derive.py `run.peft`, with the 4-bit storage dtype);
the planner's Setup asks the same questions of its peft kind (workbench/plan/setup.py).
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("none", "lora", "qlora", "dora")


@dataclass(frozen=True)
class Peft:
    kind: str  # none | lora | qlora | dora
    quant_storage: str = ""  # storage dtype of packed 4-bit weights (a float dtype when sharded)

    @property
    def adapter(self) -> bool:
        return self.kind != "none"

    @property
    def quantised(self) -> bool:
        return self.kind == "qlora"

    @property
    def dora(self) -> bool:
        return self.kind == "dora"
