"""The replay certificate: every resumed run proves it holds the weights its checkpoint was written
with, whatever layout wrote it and whatever layout reads it.

    probe = replay.probe_spec(cfg)                          # which micro-batch (in train.json)
    loss = replay.probe_loss_of(backend, probe)             # forward only, collective
    cert = replay.certificate(saved, loss, probe, written_by, here)   # -> manifest.json resume.certificate

At save time the run records the probe: the mean next-token cross-entropy (a reward model: the mean
squared score) of one fixed micro-batch
(`rows` x `len` token ids drawn from a generator seeded by train.seed, no data needed) under the
weights being saved, forward only. On resume, before the first step, the same micro-batch goes
through the loaded weights under the new layout and the two losses must agree within the
tolerance of a cross-layout forward:

- RTOL_FP32 = 1e-5. Both forwards use the same weights and tokens; only the order of the sums
  differs (tensor-parallel splits of the matmuls and of the vocabulary's log-sum-exp; FSDP2 and
  ZeRO-3 gather the same values, data parallelism does not enter: every rank runs the whole
  micro-batch). fp32 rounds to eps = 2**-23; reordering a sum of n terms moves it by about
  log2(n) roundings of its largest partial sum, and the longest sums run over the vocabulary
  (V < 2**16): 16 ulps = 1.9e-6 per evaluation. The loss is a mean of positive terms, so its
  relative change is that of its terms: the bound of tests/tolerances.py's LOSS_RTOL (84 ulps)
  covers it with room, and tests/tolerances.py re-derives and checks the same constant.
- RTOL_HALF = 2**-6 = 1.6e-2, when either side computes in bf16 or fp16 (autocast or half
  weights). Each matmul output is rounded to bf16 (one ulp is 2**-8 relative, the coarser of the
  two), and another summation order can move that rounding by one ulp. A token's cross-entropy
  lse(z) - z_y moves by at most twice the largest change of a logit (2 ulps of the logits'
  scale); the logits carry one more ulp from the rounded hidden state entering the head and one
  from the final norm: 4 ulps = 2**-6 relative to the logits' scale, which on the probe's random
  tokens is below the loss itself (the loss is about log V, above every |logit| of a model that
  has not collapsed).

A weight loaded into the wrong place, a dropped adapter or a stale moment of the weights moves
the probe far beyond either bound (tests/integration/test_resume.py flips one weight value). A
failed certificate stops the run before training with one `error:` line
(`train.resume_check=warn` only reports it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.core.errors import UserError

RTOL_FP32 = 1e-5
RTOL_HALF = 2.0**-6
PROBE_ROWS, PROBE_LEN = 2, 64


def probe_spec(cfg) -> dict:
    """The probe micro-batch, by what makes it (recorded in train.json, so a resume rebuilds it)."""
    return {"seed": int(cfg.train.seed), "rows": PROBE_ROWS, "len": PROBE_LEN, "vocab": int(cfg.model.arch.vocab)}


def probe_micro(spec: dict, device: str) -> dict:
    g = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, spec["vocab"], (spec["rows"], spec["len"]), generator=g)
    select = torch.ones_like(ids, dtype=torch.bool)
    select[:, -1] = False  # every position predicts the next token
    return {k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": torch.ones_like(ids), "select": select,
                                         "targets": ids[:, 1:].reshape(-1)}.items()}


def probe_loss(model, micro: dict):
    """The probe's loss function (a method's loss signature, so every backend runs it as its own):
    next-token cross-entropy, or, for a model with a scalar head (method=rm), the squared scores."""
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"], position_ids=None,
                   select=micro["select"])
    if logits.shape[-1] == 1:
        loss = logits.float().square().sum()
    else:
        loss = F.cross_entropy(logits.float(), micro["targets"], reduction="sum")
    return loss, {"target_tokens": float(micro["targets"].numel())}


def probe_loss_of(backend, spec: dict, device: str) -> float:
    """The mean cross-entropy of the probe under the backend's current weights (collective)."""
    micro = probe_micro(spec, device)
    return backend.forward_only(micro, probe_loss) / float(micro["targets"].numel())


def tolerance(*precisions: str) -> float:
    return RTOL_FP32 if all(p == "fp32" for p in precisions) else RTOL_HALF


def certificate(saved: dict, resumed: float, written_by: str, here: str, precisions: tuple[str, str]) -> dict:
    """What manifest.json records under resume.certificate."""
    rel = abs(resumed - saved["loss"]) / max(abs(saved["loss"]), 1e-30)
    tol = tolerance(*precisions)
    return {"from": written_by, "to": here, "probe_loss": saved["loss"], "probe_loss_resumed": resumed,
            "rel_diff": rel, "tolerance": tol, "ok": bool(rel <= tol)}


def failure(cert: dict, where: str) -> UserError:
    return UserError(f"resume certificate failed for {where}: the probe's loss was {cert['probe_loss']:.8g} when "
                     f"{cert['from']} saved it and is {cert['probe_loss_resumed']:.8g} under {cert['to']} (relative "
                     f"difference {cert['rel_diff']:.2e} > {cert['tolerance']:.1e}): these are not the weights it "
                     "saved; train.resume_check=warn continues anyway")
