"""method=sft: supervised fine-tuning, next-token cross-entropy on assistant turns.

    python -m workbench                      # LoRA SFT of SmolLM2-135M on the arithmetic task
    python -m workbench peft=none optim.lr=2e-5   # full fine-tuning

The loss of a step is the sum of token losses divided by the number of target tokens in the
whole global batch (all micro-batches, all ranks), so 1x8 and 4x2 accumulation give the same
gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.config.rule import par
from workbench.core.errors import UserError
from workbench.data.collate import pad_batch
from workbench.data.mixing import Mixture
from workbench.data.packing import Packer, attention_layout, packed_micro_batches, pad_free, sliding_window
from workbench.data.pair_tree import prefix_tree, tree_fits
from workbench.data.pipeline import tokenise_recipe
from workbench.data.recipes import load_recipe
from workbench.methods.base import Method
from workbench.methods.batching import Batcher
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.peft.lora import base_model
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch


@dataclass
class Config:
    name: str = "sft"  # the method; method=sft (or the aliases lora, qlora) sets it
    recipe: str = "arith_sft"  # data_recipes/<recipe>.yaml when data.recipe is null
    loss_on: str = "assistant"  # assistant | all


class SFT(Method):
    name = "sft"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.batch = Batcher(ctx)  # the step's rows and micro-batches (workbench/methods/batching.py)
        self.window = None  # the model's sliding window where shorter than a row (attach)
        self.tree = False  # micro-batches may share their common prefix (data.share_prefix; attach)

    def prepare(self, ctx) -> None:
        recipe = load_recipe(ctx.cfg.data.recipe)
        self.sources = tokenise_recipe(recipe, ctx.tokenizer, ctx.contract, ctx.cfg.data, self.cfg.loss_on)
        self.mixture = Mixture([len(s.examples) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=ctx.cfg.data.shuffle_seed)
        self.packer = None
        if ctx.cfg.data.packing:  # rows of seq_len tokens, several examples each (workbench/data/packing.py)

            lens = [s.examples.lengths() for s in self.sources]
            self.packer = Packer(self.mixture, lambda x: int(lens[x[0]][x[1]]),
                                 ctx.cfg.data.pack_len or ctx.cfg.data.seq_len)

    def data_report(self) -> dict:
        return {s.source.name: {**s.report(), "weight": s.source.weight} for s in self.sources}

    def _mix_info(self) -> dict:
        info = {f"mix/{s.source.name}": r for s, r in zip(self.sources, self.mixture.realised())}
        if self.packer is not None:
            info["pack/fill"] = self.packer.fill()
        return info

    def _example(self, where: tuple[int, int]):
        src, row = where
        return self.sources[src].examples[row]

    def attach(self, backend) -> None:
        """How packed rows mark where each example starts follows the model's attention: a
        sliding window shorter than a row needs position ids (packing.attention_layout)."""
        window = sliding_window(base_model(backend.unwrapped().inner).config)
        self.window = window if window and window < self.ctx.cfg.data.seq_len else None
        # tree rows need the decoder and head split and a kernel that takes a 4-D mask (tree_fits
        # says why not on stderr); packed rows (data.packing) already read every token once, and
        # backend.sp cuts rows into documents where the position ids restart, which a branch does
        self.tree = (self.ctx.run.pad_free and bool(self.ctx.cfg.data.get("share_prefix", False))
                     and not self.ctx.cfg.data.packing and par(self.ctx.cfg, "sp") <= 1
                     and tree_fits(backend.unwrapped(), self.ctx.cfg.data.seq_len, "reading each example whole"))

    def _packed_batch(self, state) -> StepBatch:
        # all ranks pack the global batch, each keeps its rows
        _, rows = self.batch.draw(state.step, self.packer.next_rows)
        layout, mask = attention_layout(self.ctx.cfg.model.attn_implementation, self.window)
        micro, real = packed_micro_batches(rows, self._example, self.batch.micro, self.ctx.tokenizer.pad_token_id,
                                           layout, mask)
        denom = float(sum(int(m["targets"].numel()) for m in micro))
        return StepBatch(micro=micro, denom=denom, tokens=real, info=self._mix_info())

    def next_batch(self, state, backend) -> StepBatch:
        if self.packer is not None:
            return self._packed_batch(state)
        _, mine = self.batch.draw(state.step, self.mixture.take)
        micro = self.batch.cut([self._example(x) for x in mine], self._collate)
        denom = float(sum(int(m["targets"].numel()) for m in micro))
        tokens = sum(m.pop("real_tokens") for m in micro)
        return StepBatch(micro=micro, denom=denom, tokens=tokens, info=self._mix_info())

    def _collate(self, examples: list) -> dict:
        """Padded rows; or the same examples as one tree row reading their common prefix once
        (data.share_prefix), or padding-free (data.pad_free), where that saves enough."""
        pad = self.ctx.tokenizer.pad_token_id
        if self.tree:
            m = prefix_tree(examples, pad, self.ctx.cfg.data.seq_len)
            if m is not None:
                return m
        if self.ctx.run.pad_free:
            m = pad_free(examples, pad, *attention_layout(self.ctx.cfg.model.attn_implementation, self.window))
            if m is not None:
                return m
        m = pad_batch(examples, pad)
        m["real_tokens"] = int(m["attention_mask"].sum())
        return m

    def loss(self, model, micro: dict):
        logp = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                     position_ids=micro.get("position_ids"), select=micro["select"], targets=micro["targets"],
                     **({"slot": micro["head_slot"]} if "head_slot" in micro else {}))  # tree rows (prefix_tree)
        # under backend.sp this rank holds a slice of each row: the sum is completed over its sp group
        loss = sequence_parallel.total(-logp.sum())
        return loss, {"target_tokens": float(micro["targets"].numel())}

    def state_dict(self) -> dict:
        state = {"mixture": self.mixture.state_dict()}
        if self.packer is not None:
            state["packer"] = self.packer.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])
        if self.packer is not None and "packer" in state:
            self.packer.load_state_dict(state["packer"])


def build(cfg, ctx) -> SFT:
    return SFT(cfg, ctx)


LOSS_ON = ("assistant", "all")


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load): any other
    loss_on would train the assistant turns only (workbench/data/chat.py reads "all" alone)."""
    if cfg.loss_on not in LOSS_ON:
        raise UserError(f"method.loss_on={cfg.loss_on!r} is not one of {list(LOSS_ON)}: assistant (the assistant "
                        "turns) or all (prompt tokens too)")


SPEC = MethodSpec(name="sft", config=Config, build=build, check=check,
                  facts=MethodFacts(data="sft", splits_rows=True))
