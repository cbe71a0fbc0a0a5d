"""method=sft: supervised fine-tuning, next-token cross-entropy on assistant turns.

    python -m workbench                      # LoRA SFT of SmolLM2-135M on the arithmetic task
    python -m workbench peft=none optim.lr=2e-5   # full fine-tuning

The loss of a step is the sum of token losses divided by the number of target tokens in the
whole global batch (all micro-batches, all ranks), so 1x8 and 4x2 accumulation give the same
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from workbench.data.collate import pad_batch
from workbench.data.mixing import Mixture
from workbench.data.pipeline import tokenise_recipe
from workbench.data.recipes import load_recipe
from workbench.methods.base import StepBatch


@dataclass
class Config:
    name: str = "sft"
    loss_on: str = "assistant"  # assistant | all


class SFT:
    name = "sft"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx

    def prepare(self, ctx) -> None:
        recipe = load_recipe(ctx.cfg.data.recipe)
        self.sources = tokenise_recipe(recipe, ctx.tokenizer, ctx.contract, ctx.cfg.data, self.cfg.loss_on)
        self.mixture = Mixture([len(s.examples) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=ctx.cfg.data.shuffle_seed)
        self._overfit: list | None = None

    def data_report(self) -> dict:
        return {s.source.name: {"rows": len(s.examples), "skipped": s.skipped, "truncated": s.truncated,
                                "fingerprint": s.fingerprint} for s in self.sources}

    def _draw(self, n: int) -> list:
        out = []
        for _ in range(n):
            src, row = self.mixture.next()
            out.append(self.sources[src].examples[row])
        return out

    def next_batch(self, state, backend) -> StepBatch:
        t = self.ctx.cfg.train
        world, rank = self.ctx.world_size, self.ctx.rank
        per_rank = t.micro_batch_size * t.grad_accum
        if self.ctx.cfg.debug.overfit_batches:
            if self._overfit is None:
                self._overfit = [self._draw(per_rank * world) for _ in range(self.ctx.cfg.debug.overfit_batches)]
            examples = self._overfit[state.step % len(self._overfit)]
        else:
            examples = self._draw(per_rank * world)  # every rank draws the global batch ...
        mine = examples[rank * per_rank:(rank + 1) * per_rank]  # ... and keeps its slice
        pad = self.ctx.tokenizer.pad_token_id
        micro = [pad_batch(mine[i:i + t.micro_batch_size], pad) for i in range(0, per_rank, t.micro_batch_size)]
        denom = float(sum(int(m["targets"].numel()) for m in micro))
        tokens = int(sum(int(m["attention_mask"].sum()) for m in micro))
        return StepBatch(micro=micro, denom=denom, tokens=tokens)

    def loss(self, model, micro: dict):
        logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], select=micro["select"])
        loss = F.cross_entropy(logits.float(), micro["targets"], reduction="sum")
        return loss, {"target_tokens": float(micro["targets"].numel())}

    def state_dict(self) -> dict:
        return {"mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])


def build(cfg, ctx) -> SFT:
    return SFT(cfg, ctx)
