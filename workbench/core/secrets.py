"""The one rule for secrets in everything a run writes or prints.

A value is secret when its key looks secret (SECRET_KEY: `token`, `hf_token`, `api_key`,
`password`, ...; not `tokenizer` or `max_new_tokens`) or when the value itself is token-shaped
(TOKEN_SHAPE: `hf_...`, `sk-...`, `ghp_...`, ...), whatever key holds it and wherever inside a
longer string it sits (a URL, `Bearer hf_...`). Secret values become REDACTED.

    clean = redact(config_dict)                    # nested dicts/lists: a redacted copy
    line = scrub_text(text, secret_values(cfg))    # raw text: token shapes and these values
    scrub_files([run / ".hydra" / "overrides.yaml"], secret_values(cfg))  # rewritten in place
    shown = redact_overrides(["+launcher.api_key=x", "optim.lr=1e-4"])    # a command line's overrides
    handler.addFilter(LogFilter())                 # log lines (conf/train.yaml sets it on Hydra's handlers)

Every writer of a run directory goes through here: config.yaml and manifest.json
(workbench/train/runner.py), Hydra's `.hydra/` and `multirun.yaml` (workbench/cli.py), the
remote job (workbench/launch/remote.py), the sweep files (workbench/launch/sweep.py), the
model card (workbench/export/card.py), the trackers (workbench/telemetry/trackers.py),
metrics.jsonl and console lines (workbench/telemetry/metrics.py), report.md and results.json,
`error:` lines (workbench/cli.py) and log lines (LogFilter).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

# Whole key names that hold secrets: token, hf_token, api_key, wandb_api_key, password, ...
# (not tokenizer, max_new_tokens or experts_per_token, which are ordinary settings).
SECRET_KEY = re.compile(
    r"^(token|(.*[_-])?(hf|auth|access|api|bearer|private)[_-]?token|"
    r"(.*[_-])?(secret|password|passwd|api[_-]?key|access[_-]?key|secret[_-]?key|credentials?))$", re.I)
REDACTED = "<redacted>"
# Token shapes that are secrets whatever key holds them: Hugging Face, OpenAI-style, GitHub
# (classic and fine-grained), Slack, AWS access key ids. The lookbehind (not \b) lets a token
# follow `_` (`my_hf_...`) but not a letter, so `task-...` or `disk-...` are not `sk-` keys.
TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
                         r"|github_pat_[A-Za-z0-9_]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})")


def secret_key(key) -> bool:
    """Whether a key's name says its value is a secret."""
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


def scrub_text(text: str, extra_secrets=()) -> str:
    """`text` with every token-shaped substring and every one of `extra_secrets` replaced."""
    clean = TOKEN_SHAPE.sub(REDACTED, text)
    for secret in sorted(set(extra_secrets), key=len, reverse=True):  # longest first: no partial leftovers
        if secret:
            clean = clean.replace(secret, REDACTED)
    return clean


def redact(obj, extra_secrets=()):
    """A copy of a nested dict/list with the values of secret-looking keys replaced, and every
    string (keys too) scrubbed of token shapes and `extra_secrets`."""
    if isinstance(obj, dict):
        return {(scrub_text(k, extra_secrets) if isinstance(k, str) else k):
                (REDACTED if secret_key(k) and v not in (None, "") else redact(v, extra_secrets))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, extra_secrets) for v in obj]
    if isinstance(obj, str):
        return scrub_text(obj, extra_secrets)
    return obj


def secret_values(cfg) -> set[str]:
    """The values of secret-looking keys anywhere in a config (DictConfig or plain container),
    for scrubbing raw text that copies them without their key (Hydra's overrides.yaml)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    found: set[str] = set()

    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            if isinstance(value, (dict, list)):
                walk(value)
            elif secret_key(key) and value not in (None, "") \
                    and not str(value).startswith("${"):  # an interpolation names the secret, it is not one
                found.add(str(value))

    walk(cfg)
    return found


def redact_overrides(overrides, extra_secrets=()) -> list[str]:
    """Command-line overrides (`key=value`) as they may be shown: a secret-looking key's value
    replaced whole, every other override scrubbed like text."""
    out = []
    for o in map(str, overrides):
        key, eq, _ = o.partition("=")
        if eq and secret_key(key.lstrip("+~").split(".")[-1]):
            out.append(f"{key}={REDACTED}")
        else:
            out.append(scrub_text(o, extra_secrets))
    return out


def scrub_files(paths, extra_secrets=()) -> None:
    """Rewrite each of these text files (absent ones skipped) with scrub_text applied; a file is
    replaced atomically, so a reader never sees it half-written."""
    for path in map(Path, paths):
        if not path.is_file():
            continue
        text = path.read_text()
        clean = scrub_text(text, extra_secrets)
        if clean != text:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(clean)
            os.replace(tmp, path)


# `key=value` words of a log line (Hydra logs each multirun job's overrides this way)
_ASSIGNMENT = re.compile(r"(?<!\S)([+~]*[\w.-]+)=(\S+)")


class LogFilter(logging.Filter):
    """A logging filter that applies the rule to each record's text: token shapes, and the value
    of a `key=value` word whose key looks secret. conf/train.yaml puts it on Hydra's own console
    handler and the job's console and file handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        clean = _ASSIGNMENT.sub(lambda m: f"{m[1]}={REDACTED}" if secret_key(m[1].lstrip("+~").split(".")[-1])
                                and not m[2].startswith("${") else m[0], scrub_text(text))
        if clean != text:
            record.msg, record.args = clean, ()
        return True
