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

Layout: with `share_prompt` (the default) a pair is one row, the prompt once and both
completions as branches (workbench/data/pair_tree.py, as DPO's); the log-probs are those of two
rows per pair up to rounding. Models that cannot take it keep two rows per pair.

Logged metrics (means over this rank's batch): rewards/chosen, rewards/rejected (b times pi_c,
pi_r), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected (pi as the loss uses
it, summed or averaged), nll/chosen (the token-mean NLL of this rank's chosen completions).

`PairStream` (workbench/methods/pairs.py) is the data side every reference-free pair method shares:
preference sources, the mixture, debug.overfit_batches and the step's micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.core.errors import UserError
from workbench.data.pair_tree import tree_batch
from workbench.methods.base import Method
from workbench.methods.logps import margin_loss, pair_logps
from workbench.methods.pairs import PairStream, preference_metrics
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.train.batch import StepBatch

LOSSES = ("sigmoid", "hinge", "ipo", "simpo")
AVERAGED = ("ipo", "simpo")  # losses on per-token mean log-probs (length-normalised)


@dataclass
class Config:
    name: str = "cpo"  # the method; method=cpo (or the alias simpo) sets it
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null
    loss_type: str = "sigmoid"  # sigmoid | hinge | ipo | simpo
    beta: float = 0.1  # > 0: scale of the reward beta x log pi (simpo: of the length-normalised log pi)
    label_smoothing: float = 0.0  # sigmoid and simpo: probability that a pair's label is flipped
    # weight of the chosen completions' NLL (CPO's behaviour-cloning term); 0 for plain SimPO
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5  # simpo only: target reward margin
    # one row per pair, the prompt shared by both completions (workbench/data/pair_tree.py);
    # false, or a model that cannot take it, gives two rows per pair
    share_prompt: bool = True


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load)."""
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
    if cfg.loss_type == "simpo":  # a sigmoid loss on the margin less gamma / beta
        return margin_loss(d - cfg.simpo_gamma / cfg.beta, "sigmoid", cfg.beta, cfg.label_smoothing)
    return margin_loss(d, cfg.loss_type, cfg.beta, cfg.label_smoothing)


class CPO(Method):
    name = "cpo"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.stream = PairStream(ctx)

    def prepare(self, ctx) -> None:
        self.stream.prepare(ctx)

    def data_report(self) -> dict:
        return self.stream.data_report()

    def attach(self, backend) -> None:
        self.stream.share_prompt(backend.unwrapped(), self.cfg.share_prompt, tree_batch)

    def next_batch(self, state, backend) -> StepBatch:
        return self.stream.step(state)

    def loss(self, model, micro: dict):
        summed_c, summed_r = pair_logps(model, micro).chunk(2)  # either layout
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


SPEC = MethodSpec(name="cpo", config=Config, build=build, check=check,
                  facts=MethodFacts(data="preference", sequences=2, eval="preference", splits_rows=True))
