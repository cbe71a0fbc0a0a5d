"""What a resume may change: the settings a checkpoint was written under against the relaunch's.

    record["settings"] = settings(cfg)          # what every checkpoint keeps (workbench/run/checkpoints.py)
    found = check(rec, cfg)                     # before any weights load: a UserError naming every change
                                                # to what the run computes, unless train.resume_changes=allow
    found.result, found.other                   # [(key, before, now), ...]
    say(found)                                  # the one console line, or None

A run directory belongs to one config. Continuing it with another learning rate, data, model,
method, precision or seed would make `results.json` and `report.md` describe one run made of two
configs, so such a change is refused in one line that names each key with both values, unless
`train.resume_changes=allow`; then the run continues and the changes are recorded in
manifest.json and report.md. Changes that leave what each step computes alone (how often it logs,
evaluates or checkpoints, `train.max_steps`, the layout: backend, hardware, micro-batch x
accumulation at the kept global batch) are allowed and listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from workbench.core.errors import UserError
from workbench.core.secrets import redact, secret_values

# Sections whose every key shapes what a step computes, and single keys elsewhere that do.
RESULT_SECTIONS = ("optim", "data", "model", "method", "peft", "precision", "reward", "env")
RESULT_KEYS = ("train.seed", "train.keep_global_batch", "kernels")
# Keys inside those sections that change memory, speed or what is printed, not the numbers a step
# computes (activation checkpointing and the chunked loss recompute the same values; the attention
# kernels compute the same attention).
NEUTRAL = ("data.preview", "data.preview_samples", "data.cache", "data.cache_dir", "model.gradient_checkpointing",
           "model.loss_chunk", "model.attn_implementation", "model.arch_from")
# Where and how a remote reward is asked (reward=http, reward=judge): a service that moved, or was
# given more time or tries, scores as it did; listed, not refused. Its headers and rubric are not here.
NEUTRAL += tuple(f"reward.{k}" for k in ("url", "base_url", "request_timeout_s", "retries", "backoff_s",
                                          "backoff_max_s", "concurrency", "max_batch", "timeout_s",
                                          "seconds_per_call", "info_path"))
# Sections recorded so that their changes can be listed; everything else (trackers, launchers,
# export, plan, debug) is neither recorded nor compared.
LISTED_SECTIONS = ("train", "backend", "hardware", "eval")
# How to resume, not what the run is: never listed as a change.
UNLISTED = ("train.resume", "train.resume_changes", "train.resume_check")


@dataclass(frozen=True)
class Changes:
    since: str = "the checkpoint"
    result: list = field(default_factory=list)  # [(key, before, now)]: what a step computes
    other: list = field(default_factory=list)   # [(key, before, now)]: cadence, length, layout
    allowed: bool = False                       # train.resume_changes=allow let `result` through

    def to_dict(self) -> dict:
        return {"since": self.since, "allowed": self.allowed,
                "result": [{"key": k, "before": b, "now": n} for k, b, n in self.result],
                "other": [{"key": k, "before": b, "now": n} for k, b, n in self.other]}


def _flat(node, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _recorded(key: str) -> bool:
    head = key.split(".", 1)[0]
    return (head in RESULT_SECTIONS or head in LISTED_SECTIONS or key in RESULT_KEYS) and key not in UNLISTED


def _changes_result(key: str) -> bool:
    if key in NEUTRAL:
        return False
    return key.split(".", 1)[0] in RESULT_SECTIONS or key in RESULT_KEYS


def settings(cfg) -> dict:
    """The settings a checkpoint records, flat (`optim.lr` -> 0.0002), secrets redacted
    (workbench/core/secrets.py): a checkpoint directory is shared and copied around."""
    raw = OmegaConf.to_container(cfg, resolve=True)
    raw.pop("hydra", None)
    flat = {k: v for k, v in _flat(raw).items() if _recorded(k)}
    return redact(json.loads(json.dumps(flat, default=str)), secret_values(cfg))


def compare(rec: dict | None, cfg) -> Changes:
    """The differences between the settings `rec` (a checkpoint's train.json) was written under and
    `cfg`'s; none for a fresh run or a checkpoint that recorded no settings."""
    if not rec or "settings" not in rec:
        return Changes()
    before, now = rec["settings"], settings(cfg)
    result, other = [], []
    for key in sorted(before.keys() & now.keys()):  # a key only one side knows is a schema change, not the user's
        if before[key] != now[key]:
            (result if _changes_result(key) else other).append((key, before[key], now[key]))
    return Changes(since=rec.get("name", "the checkpoint"), result=result, other=other,
                   allowed=bool(result) and cfg.train.resume_changes == "allow")


def _pairs(changes: list) -> str:
    return ", ".join(f"{k} {json.dumps(b)} -> {json.dumps(n)}" for k, b, n in changes)


def check(rec: dict | None, cfg) -> Changes:
    """`compare`, refusing (one line, before any weights load) a change to what the run computes
    unless train.resume_changes=allow."""
    found = compare(rec, cfg)
    if found.result and not found.allowed:
        before = ", ".join(f"{k}={json.dumps(b)}" for k, b, _ in found.result)
        raise UserError(f"{cfg.output_dir} holds a run written with {before} ({found.since}); this run changes "
                        f"{_pairs(found.result)}, so its results would describe one run made of two configs: "
                        "relaunch with the checkpoint's values, give a new output_dir (or train.resume=never), or "
                        "set train.resume_changes=allow to continue and record the change")
    return found


def say(found: Changes) -> str | None:
    """The console line for a resume that changed settings, or None."""
    parts = []
    if found.result:
        parts.append(f"{_pairs(found.result)} (train.resume_changes=allow; recorded in manifest.json and report.md)")
    if found.other:
        parts.append(f"{_pairs(found.other)} (these leave what a step computes as it was)")
    return f"resume: changed since {found.since}: " + "; ".join(parts) if parts else None
