"""The one rule for secrets in everything a run writes or prints.

A value is secret when its key looks secret (SECRET_KEY: `token`, `hf_token`, `api_key`,
`password`, `HUGGING_FACE_HUB_TOKEN`, `aws_session_token`, `Authorization`, ...; not `tokenizer`
or `max_new_tokens`), when the value itself is token-shaped (TOKEN_SHAPE: `hf_...`, `sk-...`,
`ghp_...`, `glpat-...`, `AKIA...`/`ASIA...`, ...) whatever key holds it and wherever inside a
longer string it sits (`Bearer hf_...`), when it is the password of a URL (`https://user:PASSWORD@host`),
or when it is the value of a secret-looking environment variable of this process (HF_TOKEN,
WANDB_API_KEY, ...: `env_secret_values`) or a value the process registered as secret
(`register_secret`: a reward server's token read from a variable of any name), wherever it
appears. Secret values become REDACTED.

    clean = redact(config_dict)                    # nested dicts/lists: a redacted copy
    line = scrub_text(text, secret_values(cfg))    # raw text: the rule, and these values too
    scrub_files([run / ".hydra" / "overrides.yaml"], secret_values(cfg))  # rewritten in place
    shown = redact_overrides(["+launcher.api_key=x", "optim.lr=1e-4"])    # a command line's overrides
    register_secret(os.environ["REWARD_TOKEN"])    # scrubbed everywhere from now on, whatever its name
    handler.addFilter(LogFilter())                 # log lines (conf/train.yaml sets it on Hydra's handlers)
    shown = scrub_exception(exc, secret_values(cfg))  # exc, or a scrubbed stand-in to raise (Hydra prints it)

Every text path applies the environment's secret values and the registered ones by itself, so a
caller passes only the config's (`secret_values(cfg)`).

Every writer of a run directory goes through here: config.yaml and manifest.json
(workbench/run/runner.py), Hydra's `.hydra/` and `multirun.yaml` (workbench/cli.py), the
remote job (workbench/launch/remote.py), the sweep files (workbench/launch/sweep.py), the
model card (workbench/export/card.py), the trackers (workbench/telemetry/trackers.py),
metrics.jsonl and console lines (workbench/telemetry/metrics.py), report.md and results.json,
`samples/grpo.jsonl` (workbench/methods/grpo.py), `samples/episodes.jsonl`
(workbench/methods/grpo_env.py), `stalls/` (failure.json, stall.json, the per-rank stack and
traceback files: workbench/guard/watchdog.py), `error:` lines and the traceback of an unexpected
exception (workbench/cli.py) and log lines (LogFilter).
"""

from __future__ import annotations

import logging
import os
import re
import traceback
from pathlib import Path

# Whole key names that hold secrets: token, hf_token, HUGGING_FACE_HUB_TOKEN, GITHUB_TOKEN, GH_TOKEN,
# MLFLOW_TRACKING_TOKEN, aws_session_token, api_key, private_key, password, Authorization, ...
# A key ending in `token` is secret only when it is `token` itself or one of the words below comes
# before it: pad_token, eos_token, experts_per_token and flops_per_token are ordinary settings.
SECRET_KEY = re.compile(
    r"^(token|(.*[_-])?(hf|hub|auth|oauth|access|api|bearer|private|session|refresh|github|gh|gitlab|tracking|tracker)"
    r"[_-]?token|(.*[_-])?(secret|password|passwd|api[_-]?key|access[_-]?key|secret[_-]?key|private[_-]?key"
    r"|credentials?|authorization))$", re.I)
REDACTED = "<redacted>"
# Token shapes that are secrets whatever key holds them: Hugging Face, OpenAI-style, GitHub
# (classic and fine-grained), GitLab, Slack, AWS access key ids (long-lived AKIA, temporary ASIA).
# The lookbehind (not \b) lets a token follow `_` (`my_hf_...`) but not a letter, so `task-...`
# or `disk-...` are not `sk-` keys.
TOKEN_SHAPE = re.compile(r"(?<![A-Za-z0-9])(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
                         r"|github_pat_[A-Za-z0-9_]{20,}|glpat-[A-Za-z0-9_-]{20,}|xox[abpr]-[A-Za-z0-9-]{10,}"
                         r"|A(?:KI|SI)A[0-9A-Z]{16})")
# The password of a URL's user part: `scheme://user:PASSWORD@host`. The password may hold `@`
# (the last `@` before the path ends it); `<` is excluded so a redacted password stays as it is.
URL_PASSWORD = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@'\"<>]*):([^\s/?#'\"<>]+)@")
# A value written after its key in free text: `WANDB_API_KEY=...`, `"api_key": "..."`,
# `os.environ["WANDB_API_KEY"] = "..."`, `Authorization: Bearer ...` (the optional scheme word is
# kept). `_keyed` decides which of these values go: a 40-hex one after any secret-looking key,
# any one after `Authorization`.
_KEYED_VALUE = re.compile(r"(?<![\w.-])([+~]*[A-Za-z_][\w.-]*)(['\"]?\]?\s*[:=]\s*['\"]?)"
                          r"((?:Bearer|Basic|Token|token)\s+)?([^\s'\",;}\]]+)")
# A W&B API key is 40 hex digits, the shape of a git commit sha too (manifest.json records one), so
# a bare 40-hex string is left alone: it is a secret only as the value of a secret-looking key in
# text (`WANDB_API_KEY=<hex>`), under a secret key in a dict (redact), or as the value of such an
# environment variable (env_secret_values), which catches the real key wherever it appears.
_HEX40 = re.compile(r"[0-9a-fA-F]{40}")
# Environment values shorter than this are not scrubbed on their own (`GH_TOKEN=1` must not turn
# every "1" into REDACTED); the key rule and the shapes still apply to them.
MIN_ENV_SECRET = 8


def secret_key(key) -> bool:
    """Whether a key's name says its value is a secret."""
    return isinstance(key, str) and bool(SECRET_KEY.search(key))


# (the environment as last read, its secret values): reading os.environ's raw items and comparing
# them is about 2 us, matching every name against SECRET_KEY about 150 us, and scrub_text runs for
# every string of every metrics row
_ENV_CACHE: tuple = ((), frozenset())


def env_secret_values() -> frozenset[str]:
    """The values of this process's environment variables whose names look secret (HF_TOKEN,
    WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...), at least MIN_ENV_SECRET characters long."""
    global _ENV_CACHE
    snapshot = tuple(getattr(os.environ, "_data", os.environ).items())
    if snapshot != _ENV_CACHE[0]:
        _ENV_CACHE = (snapshot, frozenset(v for k, v in os.environ.items()
                                          if secret_key(k) and len(v) >= MIN_ENV_SECRET and not v.startswith("${")))
    return _ENV_CACHE[1]


# values registered as secret by this process (register_secret), scrubbed like the environment's
_REGISTERED: set[str] = set()


def register_secret(value: str) -> None:
    """Treat `value` as a secret in everything this process writes or prints from now on: a
    credential read from an environment variable whose name does not look secret (the reward
    server's token in `reward.headers_from_env`, workbench/rollout/remote.py). Values shorter than
    MIN_ENV_SECRET are left out, as for the environment's."""
    if value and len(value) >= MIN_ENV_SECRET:
        _REGISTERED.add(value)


def _keyed(m: re.Match) -> str:
    key = m[1].lstrip("+~").rsplit(".", 1)[-1]
    if secret_key(key) and (_HEX40.fullmatch(m[4]) or key.lower().endswith("authorization")):
        return m[0][:m.start(4) - m.start(0)] + REDACTED
    return m[0]


def _literals(extra_secrets) -> list[str]:
    """`extra_secrets`, the environment's secret values and the registered ones, longest first: a
    value that holds a token shape or another value goes whole, no fragment stays."""
    return sorted({s for s in extra_secrets if s} | env_secret_values() | _REGISTERED, key=len, reverse=True)


def _scrub(text: str, literals: list[str]) -> str:
    for secret in literals:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = TOKEN_SHAPE.sub(REDACTED, text)
    if "://" in text:
        text = URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    if ":" in text or "=" in text:
        text = _KEYED_VALUE.sub(_keyed, text)
    return text


def scrub_text(text: str, extra_secrets=()) -> str:
    """`text` with every one of `extra_secrets` and of the environment's secret values, every
    token-shaped substring, every URL password and every 40-hex value of a secret key replaced."""
    return _scrub(text, _literals(extra_secrets))


def redact(obj, extra_secrets=()):
    """A copy of a nested dict/list with the values of secret-looking keys replaced, and every
    string (keys too) scrubbed like text (scrub_text)."""
    return _redact(obj, _literals(extra_secrets))


def _redact(obj, literals: list[str]):
    if isinstance(obj, dict):
        return {(_scrub(k, literals) if isinstance(k, str) else k):
                (REDACTED if secret_key(k) and v not in (None, "") else _redact(v, literals))
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_redact(v, literals) for v in obj]
    if isinstance(obj, str):
        return _scrub(obj, literals)
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


class ScrubbedError(Exception):
    """Stands in for an exception whose printed traceback held a secret: its message is that
    whole traceback (frames, source lines, chained exceptions), scrubbed."""


def scrub_exception(exc: BaseException, extra_secrets=()) -> BaseException:
    """`exc` itself when its printed traceback holds nothing to scrub, else a ScrubbedError
    carrying that traceback as scrubbed text, for code that prints what it catches (Hydra's
    error report). Text, not the frames: a frame prints its source line, which may hold the
    secret itself, and a stand-in raised in an `except` block must not chain the original."""
    text = "".join(traceback.format_exception(exc))
    clean = scrub_text(text, extra_secrets)
    return exc if clean == text else ScrubbedError(clean.rstrip("\n"))


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
