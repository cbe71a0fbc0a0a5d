"""Preference pairs for the methods without a reference (CPO/SimPO, ORPO, the reward model).

`PairStream` reads the recipe's pairs, mixes the sources, draws each step's global batch on every
rank (each keeps its slice, so the data position and the global counts need no communication) and
collates micro-batches with the method's own collate; `preference_metrics` turns a micro-batch's
rewards and log-probs into the step means DPO also logs.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.data.chat import IGNORE
from workbench.data.pair_tree import tree_fits
from workbench.data.preference import Pair, pairs_report, read_pairs
from workbench.methods.batching import Batcher
from workbench.methods.logps import collate
from workbench.train.batch import StepBatch


def completion_tokens(pair: Pair) -> int:
    """Trained positions of the chosen completion (a label predicted from the token before it)."""
    return sum(1 for y in pair.chosen[1][1:] if y != IGNORE)


class PairStream:
    """Preference pairs for a method without a reference: data, mixture, overfit, step batches.

    `nll_tokens(pair)` counts the tokens a method's NLL term averages over; `step()` records (`measure`),
    for the step it makes, `pairs` (this rank's, the divisor of its metrics), `nll_scale` (global
    pairs / global NLL tokens: a micro-batch's NLL token sum times it, summed and divided by the
    global pair count, is the step's token-mean NLL) and `nll_tokens_rank` (this rank's count).
    Every rank draws the whole global step and keeps its slice, so the global counts need no
    communication.
    """

    def __init__(self, ctx, nll_tokens: Callable[[Pair], int] = completion_tokens,
                 collate_fn: Callable[[list, int], dict] = collate):
        self.ctx = ctx
        self.nll_tokens = nll_tokens
        self.collate = collate_fn
        self.batch = Batcher(ctx)  # the step's rows and micro-batches (workbench/methods/batching.py)
        self.pairs, self.nll_scale, self.nll_tokens_rank = 1.0, 1.0, 1.0

    def prepare(self, ctx) -> None:
        self.sources, self.mixture = read_pairs(ctx.tokenizer, ctx.contract, ctx.cfg.data)

    def share_prompt(self, module, wanted: bool, tree_collate: Callable[[list, int], dict]) -> None:
        """Collate one row per pair, the prompt shared by both completions (`tree_collate`,
        workbench/data/pair_tree.py), when the method's `share_prompt` asks for it and the model
        takes that layout; otherwise keep two rows per pair (tree_fits says why on stderr)."""
        if wanted and tree_fits(module, self.ctx.cfg.data.seq_len, "using two rows per pair"):
            self.collate = tree_collate

    def data_report(self) -> dict:
        return pairs_report(self.sources)

    def step(self, state) -> StepBatch:
        drawn, own = self.batch.draw(state.step, self.mixture.take)
        pairs, mine = [self.sources[s].pairs[r] for s, r in drawn], [self.sources[s].pairs[r] for s, r in own]
        self.measure(pairs, mine)
        pad = self.ctx.tokenizer.pad_token_id
        micro = self.batch.cut(mine, lambda rows: self.collate(rows, pad))
        # the tokens the model reads: a collate of shared-prompt rows says (their mask is 4-D)
        tokens = sum(m.pop("real_tokens") if "real_tokens" in m else int(m["attention_mask"].sum()) for m in micro)
        return StepBatch(micro=micro, denom=float(len(mine)), tokens=tokens)

    def measure(self, pairs: list[Pair], mine: list[Pair]) -> None:
        """Record the step's divisors: `pairs` drawn by all ranks, `mine` this rank's slice."""
        self.pairs = float(len(mine))
        self.nll_scale = len(pairs) / max(1, sum(self.nll_tokens(p) for p in pairs))
        self.nll_tokens_rank = float(max(1, sum(self.nll_tokens(p) for p in mine)))

    def state_dict(self) -> dict:
        return {"mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])


def preference_metrics(rc, rr, pi_c, pi_r, nll_sum, stream: PairStream) -> dict[str, float]:
    """The DPO-style metrics of one micro-batch, as sums that add up to this rank's step means."""
    k = stream.pairs
    return {"rewards/chosen": float(rc.sum()) / k, "rewards/rejected": float(rr.sum()) / k,
            "rewards/margins": float((rc - rr).sum()) / k,
            "rewards/accuracies": float((rc > rr).float().sum()) / k,
            "logps/chosen": float(pi_c.sum()) / k, "logps/rejected": float(pi_r.sum()) / k,
            "nll/chosen": float(nll_sum) / stream.nll_tokens_rank}
