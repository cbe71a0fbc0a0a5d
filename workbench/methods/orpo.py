"""method=orpo: odds-ratio preference optimisation on (prompt, chosen, rejected) pairs, no reference model.

    python -m workbench method=orpo                                  # LoRA ORPO of SmolLM2-135M, arith pairs
    python -m workbench method=orpo peft=none method.beta=0.2
    python -m workbench method=orpo method.nll_on_prompt=false       # SFT term on the completion only

ORPO (Hong et al. 2024) folds SFT and preference alignment into one loss:

    L = NLL(chosen) + beta * -log s(log odds(chosen) - log odds(rejected))

where odds(y) = p / (1 - p) with log p the completion's per-token mean log-prob (so
log odds = log p - log(1 - exp(log p)), computed stably), and beta is the paper's lambda.
The NLL is TRL's ORPOTrainer's: a mean over tokens of the chosen sequences, prompt included
(`nll_on_prompt=true`: every token but the first, as a causal LM loss on the whole sequence),
or over the chosen completion only (`nll_on_prompt=false`). Like TRL's it is a mean over every
such token of the step (all micro-batches, all ranks), entering the pair-normalised step loss
as each micro-batch's token sum times pairs / tokens (workbench/methods/pairs.py, PairStream).

Layout: with `share_prompt` (the default) a pair is one row, the prompt once and both
completions as branches (workbench/data/pair_tree.py, as DPO's); with `nll_on_prompt` the chosen
branch's targets run over the shared prompt too (`tree_whole_chosen`). The log-probs are those of
two rows per pair up to rounding; models that cannot take the layout keep two rows per pair.

Logged metrics (means over this rank's batch): rewards/chosen, rewards/rejected (beta times the
mean log-probs), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (per-token
means), nll/chosen (the token-mean NLL term), log_odds_ratio (mean log s(log odds ratio)),
log_odds_chosen (mean log odds ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.core.errors import UserError
from workbench.data.chat import IGNORE
from workbench.data.pair_tree import tree_batch
from workbench.data.preference import Pair
from workbench.methods.base import Method
from workbench.methods.logps import collate, tree_token_logps
from workbench.methods.pairs import PairStream, completion_tokens, preference_metrics
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.train import sequence_parallel
from workbench.train.batch import StepBatch


@dataclass
class Config:
    name: str = "orpo"  # the method; method=orpo sets it
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null
    beta: float = 0.1  # lambda: weight of the odds-ratio term against the NLL
    nll_on_prompt: bool = True  # true: NLL over prompt + completion (TRL) | false: the completion only
    # one row per pair, the prompt shared by both completions (workbench/data/pair_tree.py);
    # false, or a model that cannot take it, gives two rows per pair
    share_prompt: bool = True


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load)."""
    if cfg.beta <= 0:
        raise UserError(f"method.beta must be > 0 (got {cfg.beta})")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0: log1p(-exp(x)) far from 0, log(-expm1(x)) near it (no cancellation)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def log_odds_ratio(mean_c: torch.Tensor, mean_r: torch.Tensor) -> torch.Tensor:
    """log(odds(chosen) / odds(rejected)) from per-token mean log-probs."""
    return (mean_c - mean_r) - (log1mexp(mean_c) - log1mexp(mean_r))


def sequence_tokens(pair: Pair) -> int:
    """Positions of the chosen sequence that predict a next token: all but the last."""
    return len(pair.chosen[0]) - 1


def collate_whole_chosen(pairs: list, pad_id: int) -> dict:
    """logps.collate, with every position of the chosen rows selected (the NLL reads the prompt too).

    `completion` marks, per selected position, those the odds ratio reads (logps.collate's select);
    rejected rows keep their completion-only select.
    """
    micro = collate(pairs, pad_id)
    n = len(pairs)
    select = micro["select"].clone()
    select[:n, :-1] = micro["attention_mask"][:n, 1:].bool()
    micro["completion"] = micro["select"][select]
    micro["select"] = select
    micro["targets"] = micro["input_ids"][:, 1:][select[:, :-1]]
    return micro


def tree_whole_chosen(pairs: list, pad_id: int) -> dict:
    """pair_tree.tree_batch with the chosen branch's targets over its whole sequence (the NLL
    reads the prompt too); `completion` marks the targets the odds ratio reads, as
    collate_whole_chosen's does, and `n_tokens` counts those per sequence (chosen 0..N-1, then
    rejected 0..N-1)."""
    n = len(pairs)
    whole = [[IGNORE] + list(p.chosen[0][1:]) for p in pairs]  # label t: token t, predicted at t - 1
    out = tree_batch(pairs, pad_id, chosen_labels=whole)
    # targets come chosen 0..N-1 (every position), then rejected 0..N-1 (completion only)
    flags = [[y != IGNORE for y in p.chosen[1][1:]] for p in pairs]  # per chosen position: completion?
    rejected = out["n_tokens"][n:]
    out["completion"] = torch.tensor([f for c in flags for f in c] + [True] * int(rejected.sum()))
    out["n_tokens"] = torch.cat([torch.tensor([sum(c) for c in flags], dtype=torch.long), rejected])
    return out


def token_logps(model, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and its row in the order of two rows per pair (chosen
    0..N-1, then rejected 0..N-1), in either layout."""
    if "head_slot" in micro:  # one row per pair (tree_whole_chosen, pair_tree.tree_batch)
        return tree_token_logps(model, micro), micro["logp_rows"]
    logp = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                 position_ids=micro.get("position_ids"), select=micro["select"], targets=micro["targets"])
    return logp, micro["select"].nonzero()[:, 0]


class ORPO(Method):
    name = "orpo"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        if cfg.nll_on_prompt:
            self.stream = PairStream(ctx, nll_tokens=sequence_tokens, collate_fn=collate_whole_chosen)
        else:
            self.stream = PairStream(ctx, nll_tokens=completion_tokens)

    def prepare(self, ctx) -> None:
        self.stream.prepare(ctx)

    def data_report(self) -> dict:
        return self.stream.data_report()

    def attach(self, backend) -> None:
        tree = tree_whole_chosen if self.cfg.nll_on_prompt else tree_batch
        self.stream.share_prompt(backend.unwrapped(), self.cfg.share_prompt, tree)

    def next_batch(self, state, backend) -> StepBatch:
        return self.stream.step(state)

    def loss(self, model, micro: dict):
        rows = micro["n_tokens"].shape[0]  # two per pair in either layout
        n = rows // 2
        logp, row = token_logps(model, micro)
        completion = micro.get("completion")
        on_completion = logp if completion is None else logp * completion
        summed = torch.zeros(rows, dtype=logp.dtype, device=logp.device).index_add(0, row, on_completion)
        summed = sequence_parallel.total(summed)  # under backend.sp the rows' other tokens are on the sp group
        n_c, n_r = micro["n_tokens"].chunk(2)
        mean_c, mean_r = summed[:n] / n_c.clamp(min=1), summed[n:] / n_r.clamp(min=1)
        # the NLL's tokens: every selected position of the chosen rows (the prompt too when selected)
        nll_sum = sequence_parallel.total(-logp[row < n].sum())
        log_odds = log_odds_ratio(mean_c, mean_r)
        ratio = F.logsigmoid(log_odds)
        total = -self.cfg.beta * ratio.sum() + self.stream.nll_scale * nll_sum
        with torch.no_grad():
            metrics = preference_metrics(self.cfg.beta * mean_c, self.cfg.beta * mean_r, mean_c, mean_r, nll_sum,
                                         self.stream)
            metrics["log_odds_ratio"] = float(ratio.sum()) / self.stream.pairs
            metrics["log_odds_chosen"] = float(log_odds.sum()) / self.stream.pairs
        return total, metrics

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def build(cfg, ctx) -> ORPO:
    return ORPO(cfg, ctx)


SPEC = MethodSpec(name="orpo", config=Config, build=build, check=check,
                  facts=MethodFacts(data="preference", sequences=2, eval="preference", splits_rows=True))
