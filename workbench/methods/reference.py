"""The frozen reference model a loss compares against (DPO, KTO, GRPO's KL), set up once.

`workbench/resolve/resolved.py` decides which (`run.reference`): `adapter`, the policy itself with its
PEFT adapters disabled (no second copy in memory), or `copy`, a frozen deep copy of the initial
model. `precomputed` log-probs are the method's own business (DPO caches them).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from workbench.core.errors import UserError

# method.reference's choices for DPO and KTO (KTO refuses precomputed); auto is adapter with peft,
# copy without (workbench/resolve/resolved.py)
REFERENCES = ("auto", "adapter", "copy", "precomputed")


class Reference:
    def __init__(self, kind: str, module):
        """kind: adapter | copy; module: the backend's unwrapped model (SelectiveLM) before step 1."""
        self.kind = kind
        self.peft_model = self.model = None
        if kind == "adapter":
            self.peft_model = module.inner
            if not hasattr(self.peft_model, "disable_adapter"):
                raise UserError("method.reference=adapter: the model has no PEFT adapters to disable")
        elif kind == "copy":
            self.model = copy.deepcopy(module).eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        else:
            raise ValueError(f"no reference model for {kind!r}")

    @classmethod
    def frozen(cls, model) -> Reference:
        """A reference that is this frozen model (tests hand one in)."""
        ref = cls.__new__(cls)
        ref.kind, ref.peft_model, ref.model = "copy", None, model
        return ref

    @torch.no_grad()
    def logps(self, fn, policy, micro: dict) -> torch.Tensor:
        """fn(model, micro) evaluated with the reference: the copy, or `policy` with adapters off."""
        if self.model is not None:
            return fn(self.model, micro)
        with self.peft_model.disable_adapter() if self.peft_model is not None else contextlib.nullcontext():
            return fn(policy, micro)
