"""Rollouts already generated, as a checkpoint keeps them: a GRPO step batch to and from plain
tensors, lists and numbers (what `torch.load(weights_only=True)` reads back; nothing is unpickled).

    saved = pending.pack(batch)                 # -> a dict for torch.save
    batch = pending.unpack(saved, device)       # the same StepBatch, its tensors on `device`

A rollout a checkpoint cannot make again is one its weights did not generate: under
`method.async_rollouts=true` the next step's rollout, sampled by the previous step's weights,
and with `method.num_iterations > 1` the rollout the next pass trains on again, sampled before
the last optimizer step. The checkpoint keeps those as they are (workbench/methods/grpo.py
`rollouts_state`); tensors go to the CPU as they are (dtype and values), so the restored step
computes what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import astuple

import torch

from workbench.train.batch import Forward, StepBatch


def pack(batch: StepBatch) -> dict:
    micro = [{k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in m.items()} for m in batch.micro]
    return {"micro": micro, "denom": float(batch.denom), "tokens": int(batch.tokens), "info": dict(batch.info),
            "forward_passes": [list(astuple(f)) for f in batch.forward_passes], "signal": float(batch.signal)}


def unpack(saved: dict, device) -> StepBatch:
    micro = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in m.items()} for m in saved["micro"]]
    return StepBatch(micro=micro, denom=saved["denom"], tokens=saved["tokens"], info=dict(saved["info"]),
                     forward_passes=[Forward(*f) for f in saved["forward_passes"]], signal=saved["signal"])


def completions(saved: dict) -> int:
    """How many completions a packed rollout holds (one target sequence each)."""
    return sum(int(m["n_tokens"].numel()) for m in saved["micro"])
