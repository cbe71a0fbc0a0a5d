"""The Tinker SDK's built-in losses, on per-token log-probs of the datums' target tokens.

Every loss is a *sum* over tokens and datums (Tinker's convention: the client scales through
`weights` or `advantages`; nothing here divides by a token count). With `logp` the model's
log-prob of each target token, `q` the sampler's (`loss_fn_inputs["logprobs"]`), `A` the
advantages and `r = exp(logp - q)`:

    cross_entropy        -sum(weights * logp)                       inputs: target_tokens, weights
    importance_sampling  -sum(r * A)                                inputs: target_tokens, logprobs, advantages
    ppo                  -sum(min(r * A, clip(r, lo, hi) * A))      + loss_fn_config clip_low_threshold (0.8),
    cispo                -sum(sg(clip(r, lo, hi)) * A * logp)         clip_high_threshold (1.2)

Each datum's output is its `logprobs` (float32, one per target token) and `elementwise_loss`;
the metrics are `loss:sum` (the SDK reduces metrics by the suffix after the colon).
`forward_backward_custom` needs nothing more: the SDK runs the custom loss on the client and
sends its gradient back as cross_entropy `weights`.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from workbench.serve.futures import ServeError

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
NEEDS = {"cross_entropy": ("target_tokens",), "importance_sampling": ("target_tokens", "logprobs", "advantages"),
         "ppo": ("target_tokens", "logprobs", "advantages"), "cispo": ("target_tokens", "logprobs", "advantages")}
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def check(loss_fn: str, config: dict, data) -> None:
    """One ServeError naming what is wrong with a forward_backward request, before it is queued."""
    if loss_fn not in LOSSES:
        extra = " (a custom loss runs client-side with forward_backward_custom)" if loss_fn == "custom" else ""
        raise ServeError(f"loss_fn {loss_fn!r} is not served here; this service has {', '.join(LOSSES)}{extra}")
    unknown = sorted(set(config) - set(CLIP)) if loss_fn in ("ppo", "cispo") else sorted(config)
    if unknown:
        raise ServeError(f"loss_fn_config {unknown} is not an option of {loss_fn}"
                         + (f" (it takes {', '.join(CLIP)})" if loss_fn in ("ppo", "cispo") else " (it takes none)"))
    if not data:
        raise ServeError("forward_backward: no datums")
    for i, d in enumerate(data):
        missing = [k for k in NEEDS[loss_fn] if k not in d.inputs]
        if missing:
            raise ServeError(f"datum {i}: {loss_fn} needs loss_fn_inputs {missing} (it has {sorted(d.inputs)})")
        if not d.tokens:
            raise ServeError(f"datum {i}: an empty model_input")
        for name, arr in d.inputs.items():
            if arr.reshape(-1).shape[0] != len(d.tokens):
                raise ServeError(f"datum {i}: loss_fn_inputs[{name!r}] has {arr.size} values for "
                                 f"{len(d.tokens)} input tokens (one per input position)")


def batch(data, device: str) -> dict:
    """The datums right-padded into one micro-batch (tensors), every loss input as float/long."""
    width = max(len(d.tokens) for d in data)
    rows = len(data)
    ids = torch.zeros(rows, width, dtype=torch.long)
    mask = torch.zeros(rows, width, dtype=torch.long)
    fields = {k: torch.zeros(rows, width, dtype=torch.long if k == "target_tokens" else torch.float32)
              for k in data[0].inputs}
    for i, d in enumerate(data):
        n = len(d.tokens)
        ids[i, :n] = torch.tensor(d.tokens)
        mask[i, :n] = 1
        for k, arr in d.inputs.items():
            if k in fields:
                fields[k][i, :n] = torch.from_numpy(np.asarray(arr).reshape(-1).astype(
                    np.int64 if k == "target_tokens" else np.float32))
    micro = {"input_ids": ids, "attention_mask": mask, **fields}
    return {k: v.to(device) for k, v in micro.items()}


def token_logprobs(model, micro: dict) -> torch.Tensor:
    """log p(target_tokens[i] | input[:i+1]) at every position, (rows, width); 0 on padding."""
    logits = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"]).logits
    targets = micro["target_tokens"].clamp(min=0)
    flat = -F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return flat.reshape(targets.shape) * micro["attention_mask"]


def make(loss_fn: str, config: dict, outputs: list):
    """`loss_fn(model, micro) -> (summed loss, metrics)` for workbench.backends.step.accumulate;
    each call appends its datums' outputs (numpy, per datum) to `outputs`."""
    lo = float(config.get("clip_low_threshold", CLIP["clip_low_threshold"]))
    hi = float(config.get("clip_high_threshold", CLIP["clip_high_threshold"]))

    def fn(model, micro: dict):
        logp = token_logprobs(model, micro)
        mask = micro["attention_mask"].float()
        if loss_fn == "cross_entropy":
            w = micro["weights"] if "weights" in micro else mask
            per = -(w * logp)
        else:
            ratio = torch.exp(logp - micro["logprobs"]) * mask
            adv = micro["advantages"]
            low = micro.get("clip_low_threshold") if "clip_low_threshold" in micro else lo
            high = micro.get("clip_high_threshold") if "clip_high_threshold" in micro else hi
            if loss_fn == "importance_sampling":
                per = -(ratio * adv)
            elif loss_fn == "ppo":
                per = -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
            else:  # cispo
                per = -(torch.clamp(ratio, low, high).detach() * adv * logp)
        per = per * mask
        lengths = micro["attention_mask"].sum(dim=1).tolist()
        lp, el = logp.detach().float().cpu().numpy(), per.detach().float().cpu().numpy()
        outputs.extend({"logprobs": lp[i, :n], "elementwise_loss": el[i, :n]} for i, n in enumerate(lengths))
        return per.sum(), {}

    return fn
