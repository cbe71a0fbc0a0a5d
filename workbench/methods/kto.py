"""method=kto: Kahneman-Tversky optimisation (Ethayarajh et al. 2024) on unpaired, labelled completions.

    python -m workbench method=kto                                   # LoRA KTO of SmolLM2-135M, arith pairs unpaired
    python -m workbench method=kto peft=none                         # full fine-tuning, frozen copy as reference
    python -m workbench method=kto method.undesirable_weight=1.33    # fewer undesirable than desirable rows
    python -m workbench method=kto method.loss_type=apo_zero_unpaired
    python -m workbench method=kto data.path=rows.jsonl              # {"prompt", "completion", "label": bool} rows

Data (workbench/data/unpaired.py): rows (prompt, completion, label) are read as they are; DPO's
preference rows each become a desirable and an undesirable example, so the default recipe is the
shipped arith_dpo pairs.

Loss, as TRL's KTOTrainer computes it. With r = log pi(y|x) - log ref(y|x) summed over the
completion's tokens and z the KL reference point:

    desirable    w_d * (1 - sigmoid(b * (r - z)))
    undesirable  w_u * (1 - sigmoid(b * (z - r)))

`apo_zero_unpaired` (APO-zero, D'Oosterlinck et al. 2024) drops z: 1 - sigmoid(b r) for desirable,
sigmoid(b r) for undesirable. The step's loss is the sum over examples divided by the global
number of examples (StepBatch.denom), which is TRL's mean over its per-device batch.

The KL reference point z estimates KL(pi || ref) from mismatched pairs: inside each micro-batch of
n examples, example i's prompt is joined to the completion of example i-1 (example 0 takes that of
example n-1; TRL's rotation by one), z = mean over the n pairs of (log pi - log ref) of that
completion, clamped at 0 and detached (no gradient flows through z; the policy's forward on these
pairs runs without autograd). Pairing and mean never leave the micro-batch, so they depend only
on which examples share a micro-batch: 2 data-parallel ranks with grad_accum=1 give the same
micro-batches, hence the same z and loss, as 1 rank with grad_accum=2 (every rank draws the whole
global batch in the same order and keeps its slice, as DPO does). TRL also estimates z once per
per-device micro-batch, then averages it over ranks before clamping; on one rank, with
train.micro_batch_size equal to TRL's per_device_train_batch_size, the two are the same
computation. A smaller micro-batch makes z a noisier estimate (fewer pairs); z needs
train.micro_batch_size >= 2 (with one example the pair is the example itself, and z equals its
own log-ratio).

Reference: `adapter` (the PEFT model with adapters disabled; the default with peft) or `copy` (a
frozen copy of the initial model; the default without), as for DPO. `precomputed` is refused:
the KL pairs are formed from whichever examples share a micro-batch, so their reference log-probs
cannot be computed before training.

Logged metrics (means over this rank's step): kl (mean of the micro-batches' z), rewards/chosen
and logps/chosen over desirable examples, rewards/rejected and logps/rejected over undesirable
ones, rewards/margins (their difference), where rewards are b * r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.config.rule import Rule
from workbench.core.errors import UserError
from workbench.data.collate import pad_batch
from workbench.data.mixing import Mixture
from workbench.data.pipeline import tokenizer_digest
from workbench.data.recipes import load_recipe
from workbench.data.unpaired import Unpaired, tokenise_unpaired
from workbench.methods.base import Method
from workbench.methods.batching import Batcher
from workbench.methods.logps import sequence_logps
from workbench.methods.reference import REFERENCES, Reference
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.train.batch import StepBatch

LOSSES = ("kto", "apo_zero_unpaired")


@dataclass
class Config:
    name: str = "kto"  # the method; method=kto sets it
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null (pairs are unpaired)
    loss_type: str = "kto"  # kto | apo_zero_unpaired
    beta: float = 0.1  # > 0: scale of the implicit reward beta x log(pi / ref) against the KL reference point
    # Weights of the desirable and undesirable losses; the KTO paper (eq. 8) suggests
    # desirable_weight * n_desirable / (undesirable_weight * n_undesirable) in [1, 4/3].
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0  # weight of the undesirable rows' loss (see desirable_weight)
    reference: str = "auto"  # auto (adapter with peft, copy without) | adapter | copy


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load). That a
    micro-batch can hold KL pairs (train.micro_batch_size >= 2) is the rule kto-kl-needs-pairs below."""
    if cfg.loss_type not in LOSSES:
        raise UserError(f"method.loss_type={cfg.loss_type!r} is not one of {list(LOSSES)}")
    if cfg.reference == "precomputed":
        raise UserError("method.reference=precomputed is not available for method=kto: its KL reference point "
                        "joins each prompt to another example's completion in the same micro-batch, so those "
                        "reference log-probs cannot be computed before training; use auto, adapter or copy")
    if cfg.reference not in REFERENCES:
        raise UserError(f"method.reference={cfg.reference!r} is not one of {[r for r in REFERENCES if r != 'precomputed']}")
    if cfg.beta <= 0:
        raise UserError(f"method.beta must be > 0 (got {cfg.beta})")
    for name in ("desirable_weight", "undesirable_weight"):
        if cfg[name] < 0:
            raise UserError(f"method.{name} must be >= 0 (got {cfg[name]})")
    if cfg.desirable_weight == 0 and cfg.undesirable_weight == 0:
        raise UserError("method.desirable_weight and method.undesirable_weight are both 0: nothing to train")


def kto_losses(r, z, desirable, cfg) -> torch.Tensor:
    """Per-example loss from the log-ratios r, the KL reference point z and the labels (bool)."""
    if cfg.loss_type == "kto":
        good, bad = 1 - torch.sigmoid(cfg.beta * (r - z)), 1 - torch.sigmoid(cfg.beta * (z - r))
    else:  # apo_zero_unpaired
        good, bad = 1 - torch.sigmoid(cfg.beta * r), torch.sigmoid(cfg.beta * r)
    return torch.where(desirable, cfg.desirable_weight * good, cfg.undesirable_weight * bad)


def collate(examples: list[Unpaired], pad_id: int, seq_len: int, kl: bool) -> dict:
    """One micro-batch: each example's own sequence, its label and, with kl, the mismatched
    sequences under `kl_*`: example i's prompt with example i-1's completion (0 with n-1)."""
    micro = pad_batch([e.sequence(seq_len) for e in examples], pad_id)
    micro["label"] = torch.tensor([e.label for e in examples], dtype=torch.bool)
    if kl:
        shifted = examples[-1:] + examples[:-1]
        pairs = pad_batch([e.sequence(seq_len, o.completion) for e, o in zip(examples, shifted)], pad_id)
        micro.update({f"kl_{k}": v for k, v in pairs.items()})
    return micro


def _kl_rows(micro: dict) -> dict:
    return {k[3:]: v for k, v in micro.items() if k.startswith("kl_")}


class KTO(Method):
    name = "kto"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.batch = Batcher(ctx)  # the step's rows and micro-batches (workbench/methods/batching.py)
        self.reference = ctx.run.reference  # workbench/resolve/resolved.py (auto -> adapter / copy)
        self.ref: Reference | None = None  # adapter / copy (workbench/methods/reference.py)
        self.kl = cfg.loss_type == "kto"
        self._counts = (1.0, 1.0, 1.0)  # examples, desirable, undesirable in this rank's step

    # -- data ----------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        data = ctx.cfg.data
        recipe = load_recipe(data.recipe)
        digest = tokenizer_digest(ctx.tokenizer)  # once for every source's cache fingerprint
        self.sources = [tokenise_unpaired(s, ctx.tokenizer, ctx.contract, data, digest) for s in recipe.sources]
        self.mixture = Mixture([len(s.examples) for s in self.sources], [s.source.weight for s in self.sources],
                               seed=data.shuffle_seed)

    def data_report(self) -> dict:
        return {s.source.name: {"examples": len(s.examples), "desirable": s.desirable, "skipped": s.skipped,
                                "truncated": s.truncated, "fingerprint": s.fingerprint} for s in self.sources}

    # -- reference -----------------------------------------------------------------------
    def attach(self, backend) -> None:
        """The reference, as DPO sets up adapter / copy (workbench/methods/dpo.py DPO.attach)."""
        self.ref = Reference(self.reference, backend.unwrapped())

    def _reference(self, model, rows: dict) -> torch.Tensor:
        return self.ref.logps(sequence_logps, model, rows)

    # -- batches -------------------------------------------------------------------------
    def next_batch(self, state, backend) -> StepBatch:
        _, drawn = self.batch.draw(state.step, self.mixture.take)
        mine = [self.sources[s].examples[r] for s, r in drawn]
        pad, seq_len = self.ctx.tokenizer.pad_token_id, self.ctx.cfg.data.seq_len
        micro = self.batch.cut(mine, lambda rows: collate(rows, pad, seq_len, self.kl))
        good = float(sum(e.label for e in mine))
        self._counts = (float(len(mine)), good, float(len(mine)) - good)
        # the trained sequences' tokens; the KL pairs only run forward (like the reference, uncounted)
        tokens = int(sum(int(m["attention_mask"].sum()) for m in micro))
        return StepBatch(micro=micro, denom=float(len(mine)), tokens=tokens)

    def loss(self, model, micro: dict):
        desirable = micro["label"]
        pi = sequence_logps(model, micro)
        r = pi - self._reference(model, micro).float()
        z = torch.zeros((), device=pi.device)
        if self.kl:
            pairs = _kl_rows(micro)
            with torch.no_grad():
                z = (sequence_logps(model, pairs) - self._reference(model, pairs).float()).mean().clamp(min=0)
        losses = kto_losses(r, z, desirable, self.cfg)
        with torch.no_grad():
            n, n_good, n_bad = self._counts
            reward = self.cfg.beta * r
            good, bad = reward[desirable].sum(), reward[~desirable].sum()
            metrics = {"kl": float(z) * desirable.numel() / n}
            if n_good:
                metrics.update({"rewards/chosen": float(good) / n_good, "logps/chosen": float(pi[desirable].sum()) / n_good})
            if n_bad:
                metrics.update({"rewards/rejected": float(bad) / n_bad,
                                "logps/rejected": float(pi[~desirable].sum()) / n_bad})
            if n_good and n_bad:
                metrics["rewards/margins"] = float(good) / n_good - float(bad) / n_bad
        return losses.sum(), metrics

    def state_dict(self) -> dict:
        return {"mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])


def build(cfg, ctx) -> KTO:
    return KTO(cfg, ctx)


def _kl_rows_on(m) -> bool:
    return m.get("loss_type", "kto") == "kto"


def second_forward(m) -> str | None:
    """loss_type=kto puts its KL rows (each prompt with another example's completion) through the
    model besides the batch itself (SPEC.second_forward)."""
    return "method=kto also runs its KL rows through it (use method.loss_type=apo_zero_unpaired)" \
        if _kl_rows_on(m) else None


RULES = (
    Rule("kto-kl-needs-pairs", {"method": "kto (loss_type=kto)", "other": "train.micro_batch_size=1"},
         lambda c, e: _kl_rows_on(c.method) and c.train.micro_batch_size < 2,
         lambda c, e: "method=kto estimates its KL reference point from pairs within a micro-batch: set "
                      f"train.micro_batch_size >= 2 (got {c.train.micro_batch_size}), or "
                      "method.loss_type=apo_zero_unpaired, which has none"),
)

SPEC = MethodSpec(name="kto", config=Config, build=build, check=check, rules=RULES, second_forward=second_forward,
                  facts=MethodFacts(data="unpaired", sequences=2, reference="method", eval="preference"))
