"""What a resume may change: the settings a checkpoint was written under against the relaunch's.

    record["settings"] = settings(cfg)          # what every checkpoint keeps (workbench/checkpoints/run.py)
    found = check(rec, cfg)                     # before any weights load: a UserError naming every change
                                                # to what the run computes, unless train.resume_changes=allow
    found.result, found.other                   # [(key, before, now), ...]
    say(found)                                  # the one console line, or None

A run directory belongs to one config. Continuing it with another learning rate, data, model,
method, precision or seed would make `results.json` and `report.md` describe one run made of two
configs, so such a change is refused in one line that names each key with both values, unless
`train.resume_changes=allow`; then the run continues and the changes are recorded in
manifest.json and report.md. An allowed change applies from the first step after the checkpoint
(`Changes.from_step`; the optimizer and schedule take optim.* from this config, not the
checkpoint: workbench/checkpoints/canonical.py `apply_schedule`), and the records say which steps ran
under which values. Changes that leave what each step computes alone (how often it logs,
evaluates or checkpoints, the layout: backend, hardware, micro-batch x accumulation at the kept
global batch) are allowed and listed.

`train.max_steps` is one of those only when the LR schedule does not depend on it (a constant
schedule). Under a linear or cosine decay the schedule is recomputed over the new length, as the
common trainers do when a run is extended (a Hugging Face Trainer or Lightning run resumed with
more steps rebuilds its scheduler for the new total): keeping each planned step's value instead
would run every added step at the floor of the old decay, which no one extending a run wants.
Recomputing changes the learning rate of every step after the checkpoint, so it is listed as a
change to the result and refused unless `train.resume_changes=allow`.
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
    from_step: int | None = None                # the first step run under the new values

    def to_dict(self) -> dict:
        return {"since": self.since, "allowed": self.allowed, "from_step": self.from_step,
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


def _changes_result(key: str, now: dict) -> bool:
    if key == "train.max_steps":
        return schedule_follows_length(now)
    if key in NEUTRAL:
        return False
    return key.split(".", 1)[0] in RESULT_SECTIONS or key in RESULT_KEYS


def schedule_follows_length(flat: dict) -> bool:
    """Whether the LR at a step depends on train.max_steps under these settings (`settings`'
    flat form): a linear or cosine decay is spread over the run's length
    (workbench/compute/optim.py `lr_factor`); a constant schedule and its warmup are not."""
    return flat.get("optim.scheduler", "constant") != "constant"


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
            (result if _changes_result(key, now) else other).append((key, before[key], now[key]))
    step = rec.get("step")
    return Changes(since=rec.get("name", "the checkpoint"), result=result, other=other,
                   allowed=bool(result) and cfg.train.resume_changes == "allow",
                   from_step=int(step) + 1 if isinstance(step, int) and (result or other) else None)


def _pairs(changes: list) -> str:
    return ", ".join(f"{k} {json.dumps(b)} -> {json.dumps(n)}" for k, b, n in changes)


def check(rec: dict | None, cfg) -> Changes:
    """`compare`, refusing (one line, before any weights load) a change to what the run computes
    unless train.resume_changes=allow."""
    found = compare(rec, cfg)
    if found.result and not found.allowed:
        before = ", ".join(f"{k}={json.dumps(b)}" for k, b, _ in found.result)
        length = (f" (optim.scheduler={cfg.optim.scheduler} spreads its decay over train.max_steps: a new length "
                  "recomputes the LR of every later step)" if any(k == "train.max_steps" for k, _, _ in found.result)
                  else "")
        raise UserError(f"{cfg.output_dir} holds a run written with {before} ({found.since}); this run changes "
                        f"{_pairs(found.result)}{length}, so its results would describe one run made of two configs: "
                        "relaunch with the checkpoint's values, give a new output_dir (or train.resume=never), or "
                        "set train.resume_changes=allow to continue and record the change")
    return found


def steps_note(found: Changes, max_steps: int) -> str:
    """Which steps ran under which values: "steps 1-8 ran with the earlier values, steps 9-16 with
    these" (and that the LR schedule is recomputed over the new length, when it is)."""
    if found.from_step is None:
        return "the steps after it run with these"
    first, note = found.from_step, ""
    if any(k == "train.max_steps" for k, _, _ in found.result):
        note = f"; the LR schedule is recomputed over train.max_steps={max_steps} from step {first}"
    before = f"steps 1-{first - 1}" if first > 2 else "step 1"
    after = f"steps {first}-{max_steps}" if max_steps > first else f"step {first}"
    return f"{before} ran with the earlier values, {after} with these{note}"


def say(found: Changes, max_steps: int | None = None) -> str | None:
    """The console line for a resume that changed settings, or None. `max_steps`: this run's
    train.max_steps (which steps run under the new values)."""
    parts = []
    if found.result:
        when = f"; {steps_note(found, max_steps)}" if max_steps is not None else ""
        parts.append(f"{_pairs(found.result)} (train.resume_changes=allow{when}; recorded in manifest.json and "
                     "report.md)")
    if found.other:
        parts.append(f"{_pairs(found.other)} (these leave what a step computes as it was)")
    return f"resume: changed since {found.since}: " + "; ".join(parts) if parts else None
