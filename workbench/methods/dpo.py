"""method=dpo: direct preference optimisation on (prompt, chosen, rejected) pairs.

    python -m workbench method=dpo                                   # LoRA DPO of SmolLM2-135M, arith pairs
    python -m workbench method=dpo method.loss_type=ipo method.beta=0.5
    python -m workbench method=dpo peft=none                         # full fine-tuning, frozen copy as reference
    python -m workbench method=dpo method.reference=precomputed      # reference log-probs computed once, cached
    python -m workbench method=dpo method.share_prompt=false         # two rows per pair (chosen, rejected)

Losses on the reference-relative log-ratio difference d = (pi_c - ref_c) - (pi_r - ref_r):
`sigmoid` -(1-e) log s(b d) - e log s(-b d) (e = label_smoothing, conservative DPO), `ipo`
(d per completion token - 1/(2b))^2 as in TRL, `hinge` relu(1 - b d); plus, with
`rpo_alpha` > 0, that times the chosen completion's per-token NLL (RPO). Log-probs are summed over
completion tokens only (SelectiveLM's `select`). The step's loss is the sum over pairs divided
by the global number of pairs (StepBatch.denom).

Layout: with `share_prompt` (the default) a pair is one row, the prompt once and the chosen and
rejected completions as two branches that cannot see each other (workbench/data/pair_tree.py):
the decoder reads each prompt once and rows are no longer padded to the longest of 2N. The
log-probs (workbench/methods/logps.py) are those of two rows per pair up to rounding. Models
that cannot take that layout (no split head, an attention kernel without 4-D masks, a short
sliding window: pair_tree.tree_unsupported) keep two rows per pair, with a note on stderr.

Reference: `adapter` (the PEFT model with adapters disabled; no second copy; the default with
peft), `copy` (a frozen copy of the initial model; the default without peft), `precomputed`
(reference log-probs of every pair computed once before training and cached in
$WORKBENCH_CACHE/ref_logps/<fingerprint>.safetensors, keyed by model and data).

Logged metrics (means over this rank's batch): rewards/chosen, rewards/rejected (b times the
log-ratios), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected, nll/chosen.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from workbench.compute import precision
from workbench.core import cache
from workbench.core.errors import UserError
from workbench.data.pair_tree import tree_batch, tree_fits
from workbench.data.preference import pairs_report, read_pairs
from workbench.methods.base import Method
from workbench.methods.batching import Batcher
from workbench.methods.logps import collate, margin_loss, pair_logps
from workbench.methods.reference import REFERENCES, Reference
from workbench.methods.spec import MethodFacts, MethodSpec
from workbench.train.batch import StepBatch

LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass
class Config:
    name: str = "dpo"  # the method; method=dpo sets it
    recipe: str = "arith_dpo"  # data_recipes/<recipe>.yaml when data.recipe is null
    loss_type: str = "sigmoid"  # sigmoid | ipo | hinge
    # > 0: scale of the implicit reward beta x log(pi / ref); higher keeps the policy nearer the
    # reference (ipo: the target margin is 1 / (2 beta))
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid only: probability that a pair's label is flipped
    # weight of the chosen completion's NLL (per-token mean) added to each pair's loss: RPO
    # (Pang et al. 2024, TRL's rpo_alpha). Keeps the chosen likelihood rising instead of DPO
    # only widening the gap, which is what lets a small model learn which number is right.
    rpo_alpha: float = 0.0
    reference: str = "auto"  # auto (adapter with peft, copy without) | adapter | copy | precomputed
    # reference=precomputed: pairs per forward when the reference log-probs are computed (once,
    # then cached)
    precompute_batch_size: int = 16
    # one row per pair, the prompt shared by both completions (workbench/data/pair_tree.py);
    # false, or a model that cannot take it, gives two rows per pair
    share_prompt: bool = True


def check(cfg) -> None:
    """The options (SPEC.check, run when the run resolves, before any weights load); method.reference=adapter
    without adapters is the rule dpo-adapter-ref-needs-peft (workbench/resolve/rules.py)."""
    if cfg.loss_type not in LOSSES:
        raise UserError(f"method.loss_type={cfg.loss_type!r} is not one of {list(LOSSES)}")
    if cfg.reference not in REFERENCES:
        raise UserError(f"method.reference={cfg.reference!r} is not one of {list(REFERENCES)}")
    if cfg.beta <= 0:
        raise UserError(f"method.beta must be > 0 (got {cfg.beta})")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise UserError(f"method.label_smoothing must be in [0, 0.5) (got {cfg.label_smoothing})")
    if cfg.rpo_alpha < 0:
        raise UserError(f"method.rpo_alpha must be >= 0 (got {cfg.rpo_alpha})")
    if cfg.label_smoothing and cfg.loss_type != "sigmoid":
        raise UserError("method.label_smoothing applies to loss_type=sigmoid only")


def dpo_loss(pi_c, pi_r, ref_c, ref_r, cfg, n_c=None, n_r=None) -> torch.Tensor:
    """Per-pair loss. n_c / n_r: completion token counts (ipo normalises by them)."""
    lr_c, lr_r = pi_c - ref_c, pi_r - ref_r
    d = lr_c / n_c.clamp(min=1) - lr_r / n_r.clamp(min=1) if cfg.loss_type == "ipo" else lr_c - lr_r
    return margin_loss(d, cfg.loss_type, cfg.beta, cfg.label_smoothing)


class DPO(Method):
    name = "dpo"

    def __init__(self, cfg, ctx):
        self.cfg = cfg
        self.ctx = ctx
        self.batch = Batcher(ctx)  # the step's rows and micro-batches (workbench/methods/batching.py)
        self.reference = ctx.run.reference  # workbench/resolve/resolved.py
        self.ref: Reference | None = None  # adapter / copy (workbench/methods/reference.py)
        self.ref_logps: list[torch.Tensor] | None = None  # per source: (rows, 2) chosen, rejected
        self._pairs_in_step = 1.0
        self.tree = False  # one row per pair (set in attach, once the model is known)

    # -- data ----------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        self.sources, self.mixture = read_pairs(ctx.tokenizer, ctx.contract, ctx.cfg.data)

    def data_report(self) -> dict:
        return pairs_report(self.sources)

    # -- reference -----------------------------------------------------------------------
    def attach(self, backend) -> None:
        """Set up the reference once the backend holds the model (before any step)."""
        module = backend.unwrapped()
        self.tree = self.cfg.share_prompt and tree_fits(module, self.ctx.cfg.data.seq_len, "using two rows per pair")
        if self.reference == "precomputed":
            self.ref_logps = self._precompute(module)
        else:
            self.ref = Reference(self.reference, module)

    def _collate(self, pairs: list) -> dict:
        """A micro-batch in this run's layout; real_tokens: the input tokens the model reads."""
        pad = self.ctx.tokenizer.pad_token_id
        if self.tree:
            return tree_batch(pairs, pad)
        micro = collate(pairs, pad)
        micro["real_tokens"] = int(micro["attention_mask"].sum())
        return micro

    def _collate_drawn(self, idx: list) -> dict:
        """The drawn (source, row) pairs collated, with their precomputed reference log-probs."""
        m = self._collate([self.sources[s].pairs[r] for s, r in idx])
        if self.ref_logps is not None:
            ref = torch.stack([self.ref_logps[s][r] for s, r in idx])
            m["ref_chosen"], m["ref_rejected"] = ref[:, 0], ref[:, 1]
        return m

    def _fingerprint(self) -> str:
        c = self.ctx.cfg
        key = {"model": [c.model.name, c.model.hub_id, c.model.path, c.model.init_seed],
               "quantised": self.ctx.run.peft.quantised, "precision": self.ctx.run.precision.name,
               "data": [s.fingerprint for s in self.sources], "sizes": [len(s.pairs) for s in self.sources]}
        if self.tree:  # equal to the two-row values up to rounding; kept apart so a cache is one layout's
            key["layout"] = "tree"
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]

    @torch.no_grad()
    def _precompute(self, module) -> list[torch.Tensor]:
        from safetensors.torch import load_file, save_file


        entry = cache.root() / "ref_logps" / self._fingerprint()
        if cache.problem(entry, ("logps.safetensors",)) is None:
            cached = load_file(str(entry / "logps.safetensors"))
            return [cached[f"source{i}"] for i in range(len(self.sources))]
        was = module.training
        module.eval()
        out, bs = [], self.cfg.precompute_batch_size
        device = self.ctx.device
        with precision.autocast(self.ctx.run.precision, device):
            for src in self.sources:
                vals = []
                for i in range(0, len(src.pairs), bs):
                    chunk = src.pairs[i:i + bs]
                    micro = self._collate(chunk)
                    micro.pop("real_tokens")
                    micro = {k: v.to(device) for k, v in micro.items()}
                    lp = pair_logps(module, micro).float().cpu()
                    vals.append(torch.stack(lp.chunk(2), dim=1))
                out.append(torch.cat(vals))
        module.train(was)
        # Every rank computes the same values; the cache's lock makes one of them the writer.
        tensors = {f"source{i}": t.contiguous() for i, t in enumerate(out)}
        cache.build(entry, lambda tmp: save_file(tensors, str(tmp / "logps.safetensors")),
                    "reference log-probs", ("logps.safetensors",))
        return out

    # -- batches -------------------------------------------------------------------------
    def next_batch(self, state, backend) -> StepBatch:
        _, mine = self.batch.draw(state.step, self.mixture.take)
        micro = self.batch.cut(mine, self._collate_drawn)
        tokens = sum(m.pop("real_tokens") for m in micro)
        self._pairs_in_step = float(len(mine))
        return StepBatch(micro=micro, denom=float(len(mine)), tokens=tokens)

    def _reference(self, model, micro) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ref_logps is not None:
            return micro["ref_chosen"], micro["ref_rejected"]
        return self.ref.logps(pair_logps, model, micro).chunk(2)

    def loss(self, model, micro: dict):
        ref_c, ref_r = self._reference(model, micro)
        pi_c, pi_r = pair_logps(model, micro).chunk(2)
        n_c, n_r = micro["n_tokens"].chunk(2)
        per_pair = dpo_loss(pi_c, pi_r, ref_c.float(), ref_r.float(), self.cfg, n_c, n_r)
        nll = -pi_c / n_c.clamp(min=1)
        if self.cfg.rpo_alpha:
            per_pair = per_pair + self.cfg.rpo_alpha * nll
        with torch.no_grad():
            rc, rr = self.cfg.beta * (pi_c - ref_c), self.cfg.beta * (pi_r - ref_r)
            k = self._pairs_in_step
            metrics = {"rewards/chosen": float(rc.sum()) / k, "rewards/rejected": float(rr.sum()) / k,
                       "rewards/margins": float((rc - rr).sum()) / k,
                       "rewards/accuracies": float((rc > rr).float().sum()) / k,
                       "logps/chosen": float(pi_c.sum()) / k, "logps/rejected": float(pi_r.sum()) / k,
                       "nll/chosen": float(nll.sum()) / k}
        return per_pair.sum(), metrics

    def state_dict(self) -> dict:
        return {"mixture": self.mixture.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.mixture.load_state_dict(state["mixture"])


def build(cfg, ctx) -> DPO:
    return DPO(cfg, ctx)


SPEC = MethodSpec(name="dpo", config=Config, build=build, check=check,
                  facts=MethodFacts(data="preference", sequences=2, reference="method", precomputed_reference=True,
                                    eval="preference", splits_rows=True))
