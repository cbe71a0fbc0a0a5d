"""method=rm: a reward model trained on (prompt, chosen, rejected) pairs (Bradley-Terry).

    python -m workbench method=rm                                   # LoRA RM of SmolLM2-135M, arith pairs
    python -m workbench method=rm peft=none method.center_rewards_coefficient=0.01
    python -m workbench method=rm data.path=pairs.jsonl data.eval_split=0.05   # rows may carry "margin"
    python -m workbench method=grpo reward=model reward.path=runs/<rm run>     # use it as GRPO's reward

The model is the causal LM with a scalar head in place of its vocabulary head
(workbench/models/value_head.py), read at each sequence's last non-padding token. Per pair,
with r_c and r_r the chosen and rejected sequences' rewards and m the row's optional `margin`
column (0 without one):

    loss = -log sigmoid(r_c - r_r - m) + center_rewards_coefficient * (r_c + r_r)^2

The second term (Eisenstein et al. 2023, TRL's center_rewards_coefficient) keeps the rewards
centred on zero. The step's loss is the sum over pairs divided by the global number of pairs
(StepBatch.denom), so it equals TRL's RewardTrainer's batch mean. Sequences are tokenised exactly
as DPO's: prompt through the chat template, then the assistant reply and its end-of-turn token.

Layout: with `share_prompt` (the default) a pair is one row, the prompt once and the chosen and
rejected completions as two branches that cannot see each other (workbench/data/pair_tree.py,
as DPO's), and the head reads each branch's last token (`tree_collate`): the decoder reads each
prompt once, and the rewards are those of two rows per pair up to rounding. Without it, or for a
model that cannot take that layout (pair_tree.tree_unsupported), chosen and rejected are rows of
one micro-batch ([chosen..., rejected...], `collate`, as DPO's). The held-out evaluations
(`reward_accuracy`, `arith_rm`: pair_rewards) read pairs in the shared layout too, where the
model takes it (2.2x faster on SmolLM2 and the 100 embedded held-out pairs: `python
scripts/bench.py pair_eval`); the export's parity gate keeps two right-padded rows, the batch
the classifier reads.

With peft the head trains beside the adapters (it is created after PEFT froze the base). The
export (workbench/export/write.py) is a transformers *ForSequenceClassification with the adapters
merged: `AutoModelForSequenceClassification.from_pretrained(<run>/export/merged)` scores as the
trained model did.

Logged metrics (means over this rank's batch): rewards/chosen, rewards/rejected,
rewards/margins (r_c - r_r), rewards/accuracies (r_c > r_r).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workbench.core.errors import UserError
from workbench.data.pair_tree import columns, takes_pairs, tree_batch
from workbench.methods import logps
from workbench.methods.base import Method
from workbench.methods.pairs import PairStream
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.models import value_head
from workbench.models.head import SelectiveLM
from workbench.train.batch import StepBatch


@dataclass
class Config:
    name: str = "rm"  # the method; method=rm sets it
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null
    # weight of the mean squared summed reward (r_c + r_r)^2 added to the loss; 0: off
    center_rewards_coefficient: float = 0.0
    # one row per pair, the prompt shared by both completions (workbench/data/pair_tree.py);
    # false, or a model that cannot take it, gives two rows per pair
    share_prompt: bool = True


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load)."""
    if cfg.center_rewards_coefficient < 0:
        raise UserError(f"method.center_rewards_coefficient must be >= 0 (got {cfg.center_rewards_coefficient})")


def collate(pairs: list, pad_id: int) -> dict:
    """One micro-batch: rows [chosen_0..chosen_n-1, rejected_0..rejected_n-1], `select` at each
    row's scored position, `margin` per pair (0 where the row has none)."""
    micro = logps.collate(pairs, pad_id)
    micro["select"] = value_head.pool(micro["input_ids"], pad_id)
    del micro["targets"], micro["n_tokens"]
    micro["margin"] = torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32)
    return micro


def tree_collate(pairs: list, pad_id: int) -> dict:
    """One row per pair (pair_tree.tree_batch: the shared prefix once, then the chosen and the
    rejected branch), `select` at each completion's last token, and `reward_slot`, which of the
    head's outputs (selected positions in row-major order) is each row of `collate`'s order
    (chosen 0..N-1, then rejected 0..N-1). A micro-batch holding a pair whose two completions are
    the same tokens (both would end on one position) is collated as two rows per pair instead."""
    tree = tree_batch(pairs, pad_id)
    # tree_batch keeps branch_batch's per-sequence fields in pair order (chosen, rejected, ...)
    cols = columns(tree, [len(x) - 1 for p in pairs for x in (p.chosen[0], p.rejected[0])]).view(-1, 2)
    if bool((cols[:, 0] == cols[:, 1]).any()):
        micro = collate(pairs, pad_id)
        micro["real_tokens"] = int(micro["attention_mask"].sum())
        return micro
    rows = torch.arange(len(pairs)).repeat(2)
    cols = cols.t().reshape(-1)  # chosen 0..N-1, then rejected 0..N-1
    select = torch.zeros_like(tree["input_ids"], dtype=torch.bool)
    select[rows, cols] = True
    slot = (select.flatten().cumsum(0) - 1).view(select.shape)
    return {"input_ids": tree["input_ids"], "attention_mask": tree["attention_mask"],
            "position_ids": tree["position_ids"], "select": select, "reward_slot": slot[rows, cols],
            "margin": torch.tensor([p.margin or 0.0 for p in pairs], dtype=torch.float32),
            "real_tokens": tree["real_tokens"]}


def rm_loss(r_c: torch.Tensor, r_r: torch.Tensor, margin: torch.Tensor, center: float) -> torch.Tensor:
    """Per-pair loss (see the module docstring)."""
    loss = -F.logsigmoid(r_c - r_r - margin)
    if center:
        loss = loss + center * (r_c + r_r) ** 2
    return loss


class RewardModel(Method):
    name = "rm"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.stream = PairStream(ctx, collate_fn=collate)  # workbench/methods/pairs.py

    def prepare(self, ctx) -> None:
        self.stream.prepare(ctx)

    def data_report(self) -> dict:
        return self.stream.data_report()

    def attach(self, backend) -> None:
        """The scalar head comes from build_model (catalog facts: scalar_head); without it the
        loss would read a vocabulary logit as a reward."""
        module = backend.unwrapped()
        if not value_head.is_attached(module.inner):
            raise RuntimeError("method=rm: the model has no scalar head; build_model attaches it for methods "
                               "whose catalog facts say scalar_head=True")
        self.stream.share_prompt(module, self.cfg.share_prompt, tree_collate)

    def next_batch(self, state, backend) -> StepBatch:
        return self.stream.step(state)

    def loss(self, model, micro: dict):
        r_c, r_r = value_head.scores(model, micro).chunk(2)
        per_pair = rm_loss(r_c, r_r, micro["margin"], self.cfg.center_rewards_coefficient)
        with torch.no_grad():
            k = self.stream.pairs
            metrics = {"rewards/chosen": float(r_c.sum()) / k, "rewards/rejected": float(r_r.sum()) / k,
                       "rewards/margins": float((r_c - r_r).sum()) / k,
                       "rewards/accuracies": float((r_c > r_r).float().sum()) / k}
        return per_pair.sum(), metrics

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


@torch.no_grad()
def pair_rewards(model, pairs: list, pad_id: int, batch_size: int = 16, autocast=None,
                 share_prompt: bool = True) -> torch.Tensor:
    """(2, pairs) rewards of chosen and rejected with a model that carries the scalar head (HF or
    PEFT, not wrapped); used by the reward_accuracy and arith_rm evaluations and the export's
    parity gate. With `share_prompt` each pair is one row, its prompt read once (tree_collate,
    as training reads it) where the model takes that layout; otherwise two right-padded rows."""
    import contextlib


    lm = SelectiveLM(model)
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    layout = tree_collate if share_prompt and takes_pairs(lm, pairs) else collate
    out = []
    for i in range(0, len(pairs), batch_size):
        micro = layout(pairs[i:i + batch_size], pad_id)
        micro = {k: v.to(device) for k, v in micro.items() if isinstance(v, torch.Tensor)}
        with autocast or contextlib.nullcontext():
            out.append(value_head.scores(lm, micro).cpu().view(2, -1))
    model.train(was)
    return torch.cat(out, dim=1)


def build(cfg, ctx) -> RewardModel:
    return RewardModel(cfg, ctx)


SPEC = MethodSpec(name="rm", config=Config, build=build, check=check,
                  facts=MethodFacts(data="preference", sequences=2, scalar_head=True, eval="reward_accuracy",
                                    embedded_eval="arith_rm"))
