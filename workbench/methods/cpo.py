"""method=cpo: contrastive preference optimisation on (prompt, chosen, rejected) pairs, no reference model.

    python -m workbench method=cpo                                   # LoRA CPO of SmolLM2-135M, arith pairs
    python -m workbench method=cpo peft=none method.loss_type=hinge
    python -m workbench method=simpo                                 # SimPO: method=cpo, loss_type=simpo, cpo_alpha=0
    python -m workbench method=simpo method.beta=2.5 method.simpo_gamma=1.4

CPO (Xu et al. 2024) is DPO with the reference log-probs dropped, plus a behaviour-cloning term
on the chosen completion. With pi_c, pi_r the policy's log-probs of the chosen and rejected
completions (summed over completion tokens for sigmoid and hinge, averaged per completion token
for ipo and simpo, as TRL's CPOTrainer does) and d = pi_c - pi_r, each pair's loss is

    sigmoid  -(1-e) log s(b d) - e log s(-b d)            (e = label_smoothing)
    hinge    relu(1 - b d)
    ipo      (d - 1/(2b))^2
    simpo    sigmoid on d - gamma/b: SimPO (Meng et al. 2024), length-normalised, margin simpo_gamma

and the step adds cpo_alpha times the NLL of the chosen completions. That NLL is a mean over
every chosen completion token of the whole step (all micro-batches, all ranks), which is what
TRL computes for its (single) batch; it weights a pair by its length, not each pair equally
(DPO's rpo_alpha averages per pair instead). The step's loss is the sum over pairs divided by
the global number of pairs (StepBatch.denom), so the NLL enters as each micro-batch's token sum
scaled by pairs / tokens of the step.

Logged metrics (means over this rank's batch): rewards/chosen, rewards/rejected (b times pi_c,
pi_r), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (pi as the loss uses
it, summed or averaged), nll/chosen (the token-mean NLL of this rank's chosen completions).

`PairStream` below is the data side every reference-free preference method shares (ORPO too):
preference sources, the mixture, debug.overfit_batches and the step's micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.batch import StepBatch
from workbench.data.formats import IGNORE
from workbench.data.mixing import Mixture
from workbench.data.overfit import Overfit
from workbench.data.preference import Pair, tokenise_preferences
from workbench.data.recipes import load_recipe
from workbench.errors import UserError
from workbench.methods.base import Method
from workbench.methods.dpo import collate, sequence_logps

LOSSES = ("sigmoid", "hinge", "ipo", "simpo")
AVERAGED = ("ipo", "simpo")  # losses on per-token mean log-probs (length-normalised)


@dataclass
class Config:
    name: str = "cpo"
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null
    loss_type: str = "sigmoid"  # sigmoid | hinge | ipo | simpo
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid and simpo: probability that a pair's label is flipped
    # weight of the chosen completions' NLL (CPO's behaviour-cloning term); 0 for plain SimPO
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5  # simpo only: target reward margin


def check(cfg) -> None:
    """Validate the options before any weights load."""
    if cfg.loss_type not in LOSSES:
        raise UserError(f"method.loss_type={cfg.loss_type!r} is not one of {list(LOSSES)}")
    if cfg.beta <= 0:
        raise UserError(f"method.beta must be > 0 (got {cfg.beta})")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise UserError(f"method.label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing})")
    if cfg.label_smoothing and cfg.loss_type not in ("sigmoid", "simpo"):
        raise UserError(f"method.label_smoothing applies to loss_type=sigmoid or simpo, not {cfg.loss_type}")
    if cfg.cpo_alpha < 0:
        raise UserError(f"method.cpo_alpha must be >= 0 (got {cfg.cpo_alpha})")
    if cfg.simpo_gamma < 0:
        raise UserError(f"method.simpo_gamma must be >= 0 (got {cfg.simpo_gamma})")


def cpo_loss(pi_c: torch.Tensor, pi_r: torch.Tensor, cfg) -> torch.Tensor:
    """Per-pair loss on the policy's log-probs (already averaged per token for ipo / simpo)."""
    d = pi_c - pi_r
    if cfg.loss_type == "hinge":
        return torch.relu(1 - cfg.beta * d)
    if cfg.loss_type == "ipo":
        return (d - 1 / (2 * cfg.beta)) ** 2
    if cfg.loss_type == "simpo":
        d = d - cfg.simpo_gamma / cfg.beta
    e = cfg.label_smoothing
    return -(1 - e) * F.logsigmoid(cfg.beta * d) - e * F.logsigmoid(-cfg.beta * d)


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
        self.overfit = Overfit(ctx.cfg.debug.overfit_batches)  # workbench/data/overfit.py
        self.pairs, self.nll_scale, self.nll_tokens_rank = 1.0, 1.0, 1.0

    def prepare(self, ctx) -> None:
        data = ctx.cfg.data
        recipe = load_recipe(data.recipe)
        self.sources = [tokenise_preferences(s, ctx.tokenizer, ctx.contract, data) for s in recipe.sources]
        self.mixture = Mixture([len(s.pairs) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=data.shuffle_seed)

    def data_report(self) -> dict:
        return {s.source.name: {"pairs": len(s.pairs), "skipped": s.skipped, "truncated": s.truncated,
                                "fingerprint": s.fingerprint} for s in self.sources}

    def step(self, state) -> StepBatch:
        t = self.ctx.cfg.train
        world, rank = self.ctx.run.layout.dp, self.ctx.run.layout.dp_rank
        per_rank = t.micro_batch_size * t.grad_accum
        drawn = self.overfit.take(state.step, lambda: [self.mixture.next() for _ in range(per_rank * world)])
        pairs = [self.sources[s].pairs[r] for s, r in drawn]
        mine = pairs[rank * per_rank:(rank + 1) * per_rank]
        self.measure(pairs, mine)
        pad = self.ctx.tokenizer.pad_token_id
        micro = []
        for i in range(0, per_rank, t.micro_batch_size):
            m = self.collate(mine[i:i + t.micro_batch_size], pad)
            micro.append({k: v.to(self.ctx.device) for k, v in m.items()})
        tokens = int(sum(int(m["attention_mask"].sum()) for m in micro))
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


class CPO(Method):
    name = "cpo"

    def __init__(self, cfg, ctx):
        check(cfg)
        self.cfg = cfg
        self.ctx = ctx
        self.stream = PairStream(ctx)

    def prepare(self, ctx) -> None:
        self.stream.prepare(ctx)

    def data_report(self) -> dict:
        return self.stream.data_report()

    def next_batch(self, state, backend) -> StepBatch:
        return self.stream.step(state)

    def loss(self, model, micro: dict):
        summed_c, summed_r = sequence_logps(model, micro).chunk(2)
        n_c, n_r = micro["n_tokens"].chunk(2)
        if self.cfg.loss_type in AVERAGED:
            pi_c, pi_r = summed_c / n_c.clamp(min=1), summed_r / n_r.clamp(min=1)
        else:
            pi_c, pi_r = summed_c, summed_r
        nll_sum = -summed_c.sum()  # over every chosen completion token of this micro-batch
        total = cpo_loss(pi_c, pi_r, self.cfg).sum()
        if self.cfg.cpo_alpha:
            total = total + self.cfg.cpo_alpha * self.stream.nll_scale * nll_sum
        with torch.no_grad():
            metrics = preference_metrics(self.cfg.beta * pi_c, self.cfg.beta * pi_r, pi_c, pi_r, nll_sum,
                                         self.stream)
        return total, metrics

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def build(cfg, ctx) -> CPO:
    return CPO(cfg, ctx)
