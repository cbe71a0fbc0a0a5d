"""`reward=http`: GRPO rewards from a reward server over HTTP (a sandbox, a math checker, a service
another team runs).

    python -m workbench.rollout.reward_server --reward arith_exact --port 8000 &    # a reference server
    python -m workbench method=grpo reward=http reward.url=http://127.0.0.1:8000
    REWARD_TOKEN=... python -m workbench method=grpo reward=http reward.url=https://rewards.example \\
        '+reward.headers_from_env={Authorization: "Bearer $REWARD_TOKEN"}'

The protocol (docs/guides/grpo.md, "Rewards from a server"):

    POST <url><score_path>   {"items": [{"prompt": <messages or str>, "completion": str, <row fields>...}, ...]}
    200                      {"scores": [float, ...], "info": [dict or null, ...]}     # "info" optional
    GET  <url><health_path>  200, optionally {"columns": ["answer", ...]}: the row fields it reads

One score per item, in order, each a finite number. The row fields are the prompt row's other
columns (`answer`, ...). A generation batch is cut into requests of at most `max_batch` items,
sent `concurrency` at a time. A request that times out (`request_timeout_s`), cannot connect, is
cut off, or is answered 5xx, 408 or 429 is tried again, `retries` times, after `backoff_s`
seconds, doubled each time up to `backoff_max_s` (or the server's Retry-After, within that cap).
An answer that breaks the protocol (not JSON, scores missing, the wrong number of them, a
non-number, NaN or inf) and any other 4xx are not retried: the service is wrong, not busy. Then
the run stops with one line naming the URL (without its query or user part), the HTTP status
where there was one and an excerpt of the body. Nothing waits longer than `reward.timeout_s` in
all (the limit rewards.score puts on every reward function, the watchdog's phase "reward function"
behind it): the client gives up just before it, naming the last failure.

Headers: `headers` are sent as written and land in config.yaml, so a secret-looking one
(Authorization, X-Api-Key, ...) is refused there; `headers_from_env` maps a header to a template
whose `$NAME` parts are read from the environment when the reward is resolved. The values read
are registered with workbench/core/secrets.py, so they are scrubbed from every line and file the
run writes, whatever the variable is called; config.yaml keeps the template, never the value.

Before any weights load (rewards.check_columns, from GRPO's prepare), the service is asked
whether it is up: GET <url><health_path>, or with `health_path: null` a POST of zero items that
must be answered `{"scores": []}`; a service that is down fails the run there, in one line.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import string
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from workbench.core import secrets
from workbench.core.errors import UserError

# The part of reward.timeout_s the client itself may use: it gives up first, naming the last
# failure, before rewards.score's hard limit (call_with_limit) stops it with a generic line.
OWN_SHARE = 0.95
EXCERPT = 200  # characters of a response body quoted in an error
MAX_BODY = 64 * 2**20  # a scores answer is a few bytes per item; more than this is not one
ERROR_BODY = 2**20  # of an error answer, only this much is read: the excerpt comes from its start
RETRY_STATUS = frozenset({408, 429})  # besides 5xx: the service is busy, not wrong


class RewardServiceError(UserError):
    """A reward service failed or broke the protocol; the message is one line, without secrets.
    rewards.score passes it on as it is (a service is not re-asked sample by sample)."""


@dataclass(frozen=True)
class Settings:
    url: str  # the service's base URL, without a trailing slash
    score_path: str = "/score"
    health_path: str | None = "/health"
    request_timeout_s: float = 60.0
    retries: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_batch: int = 64
    concurrency: int = 4
    timeout_s: float = 300.0  # reward.timeout_s: all the requests of one generation batch
    headers: tuple = ()  # (name, value) pairs sent as written
    info_path: str | None = None

    def public(self, path: str) -> str:
        """`url + path` as errors show it: no user part, no query (either may carry a key)."""
        return public_url(self.url + path)

    def schedule(self) -> str:
        if not self.retries:
            return "reward.retries=0"
        return (f"{self.retries} {'retry' if self.retries == 1 else 'retries'}, backoff {self.backoff_s:g} s "
                f"doubling up to {self.backoff_max_s:g} s")


def public_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def _field(spec, key: str, default, kind, check, need: str):
    value = spec.get(key, default) if hasattr(spec, "get") else default
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise UserError(f"reward.{key}: not a {'whole ' if kind is int else ''}number: {value!r}") from None
    if not check(value):
        raise UserError(f"reward.{key}={value}: must be {need}")
    return value


def check_url(value, key: str = "url") -> str:
    """reward.<key> as a base URL without a trailing slash; UserError when it is not an http(s)
    URL with a host, or carries a user or password (never sent: a secret would land in config.yaml)."""
    url = str(value).rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"reward.{key}={public_url(url)!s}: not an http:// or https:// URL with a host")
    if parts.username or parts.password:
        raise UserError(f"reward.{key}={public_url(url)}: a user or password in the URL is not sent; put the credential "
                        "in the environment and name it in reward.headers_from_env")
    return url


def client_fields(spec) -> dict:
    """The settings every HTTP reward client shares (timeouts, retries, concurrency, plain
    headers), checked: keyword arguments of Settings. reward=judge reads the same ones."""
    get = spec.get if hasattr(spec, "get") else {}.get
    plain = {str(k): str(v) for k, v in (get("headers") or {}).items()}
    for name in plain:
        if secrets.secret_key(name):
            raise UserError(f"reward.headers.{name}: a secret would be written to config.yaml and the logs; put it in "
                            f"the environment and name it in reward.headers_from_env instead "
                            f"(e.g. {{{name}: \"Bearer $MY_TOKEN\"}})")
    return dict(
        request_timeout_s=_field(spec, "request_timeout_s", 60.0, float, lambda v: v > 0, "> 0 (seconds)"),
        retries=_field(spec, "retries", 3, int, lambda v: v >= 0, ">= 0"),
        backoff_s=_field(spec, "backoff_s", 1.0, float, lambda v: v >= 0, ">= 0 (seconds)"),
        backoff_max_s=_field(spec, "backoff_max_s", 30.0, float, lambda v: v >= 0, ">= 0 (seconds)"),
        concurrency=_field(spec, "concurrency", 4, int, lambda v: v >= 1, ">= 1 (requests in flight)"),
        timeout_s=_field(spec, "timeout_s", 300.0, float, lambda v: v > 0, "> 0 (seconds)"),
        headers=tuple(plain.items()))


def settings(spec) -> tuple[Settings, dict[str, str]]:
    """The client's settings from the reward node, and the headers read from the environment
    (kept apart: only the Settings may be shown). UserError naming the field that is wrong."""
    get = spec.get if hasattr(spec, "get") else {}.get
    url = get("url")
    if not url or str(url) in ("None", "null"):
        raise UserError("reward=http needs reward.url: the reward server's base URL, e.g. reward.url=http://127.0.0.1:8000 "
                        "(python -m workbench.rollout.reward_server serves a built-in reward there)")
    url = check_url(url)
    paths = {}
    for key, default in (("score_path", "/score"), ("health_path", "/health")):
        value = get(key, default)
        if value is None or str(value) in ("", "None", "null"):
            if key == "score_path":
                raise UserError("reward.score_path: empty; the path the scores are POSTed to, e.g. /score")
            paths[key] = None
        else:
            paths[key] = "/" + str(value).lstrip("/")
    common = client_fields(spec)
    s = Settings(
        url=url, score_path=paths["score_path"], health_path=paths["health_path"],
        max_batch=_field(spec, "max_batch", 64, int, lambda v: v >= 1, ">= 1 (completions per request)"),
        info_path=_path(get("info_path")), **common)
    return s, env_headers(get("headers_from_env") or {})


def _path(value) -> str | None:
    return None if value is None or str(value) in ("", "None", "null") else str(value)


def env_headers(templates) -> dict[str, str]:
    """Each header's template with its `$NAME` parts read from the environment; every value read
    (and the header it makes) is a secret from here on (workbench/core/secrets.py)."""
    out = {}
    for name, template in templates.items():
        t = string.Template(str(template))
        names = t.get_identifiers()
        if not t.is_valid() or not names:
            raise UserError(f"reward.headers_from_env.{name}={str(template)!r}: name an environment variable as $NAME "
                            "(e.g. \"Bearer $REWARD_TOKEN\"); a value written here would be written to config.yaml")
        unset = [v for v in names if not os.environ.get(v)]
        if unset:
            raise UserError(f"reward.headers_from_env.{name}: the environment variable(s) {unset} are not set; export "
                            "them where the run starts")
        for var in names:
            secrets.register_secret(os.environ[var])
        out[str(name)] = t.substitute({v: os.environ[v] for v in names})
        secrets.register_secret(out[str(name)])
    return out


class _Failure(Exception):
    """One request's failure: `line` says what happened (status and body excerpt, if any);
    `retry` whether trying again may help; `wait` the server's Retry-After, if it gave one."""

    def __init__(self, line: str, retry: bool, wait: float | None = None):
        super().__init__(line)
        self.line, self.retry, self.wait = line, retry, wait


def _excerpt(body: bytes, partial: bool = False) -> str:
    """The start of a body on one line, scrubbed (a careless service may echo the request's
    headers back). Scrubbed whole before it is cut, so no part of a secret survives the cut; of a
    body read only in part, the last KiB goes too (it may end inside a secret)."""
    text = body.decode("utf-8", "replace")
    if partial:
        text = text[:-1024]
    text = " ".join(secrets.scrub_text(text).split())
    return repr(text[:EXCERPT] + ("..." if len(text) > EXCERPT else ""))


def _read(resp, deadline: float, limit: int = MAX_BODY) -> tuple[bytes, bool]:
    """The body, chunk by chunk, and whether it was longer than `limit` (then its first `limit`
    bytes and more): the socket timeout bounds each read, the deadline all of them (a server
    that trickles bytes must not outlast reward.timeout_s)."""
    chunks, size = [], 0
    while size <= limit:
        if time.monotonic() > deadline:
            raise TimeoutError("the answer did not finish in time")
        chunk = resp.read(65536)
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks), True


def _retry_after(headers) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After"))) if headers and headers.get("Retry-After") else None
    except (TypeError, ValueError):  # an HTTP date: the doubling backoff instead
        return None


def request(s: Settings, secret: dict, method: str, path: str, payload, timeout: float, deadline: float,
            json_only: bool = True):
    """One HTTP request; the decoded JSON answer (None for another body when not json_only), or
    _Failure."""
    data = None if payload is None else json.dumps(payload, default=str).encode()
    headers = {"Accept": "application/json", **dict(s.headers), **secret}
    if data is not None:
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(s.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, (body, more) = resp.status, _read(resp, deadline)
    except urllib.error.HTTPError as exc:  # a status >= 400, with its body
        try:
            body, more = _read(exc, min(deadline, time.monotonic() + timeout), ERROR_BODY)
        except (OSError, http.client.HTTPException):
            body, more = b"", False
        reason = f" {exc.reason}" if exc.reason else ""
        raise _Failure(f"answered HTTP {exc.code}{reason}: body {_excerpt(body, more)}",
                       retry=exc.code >= 500 or exc.code in RETRY_STATUS, wait=_retry_after(exc.headers)) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _connection_failure(exc, timeout, s) from None
    if more:
        raise _Failure(f"answered HTTP {status} with more than {MAX_BODY // 2**20} MiB: not a scores answer; body "
                       f"{_excerpt(body, partial=True)}", retry=False)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        if not json_only:  # a health check may answer "ok"
            return None
        raise _Failure(f"answered HTTP {status} but not JSON: body {_excerpt(body)}", retry=False) from None


def _connection_failure(exc: BaseException, timeout: float, s: Settings) -> _Failure:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, (TimeoutError, socket.timeout)) or "timed out" in str(reason):
        which = ("reward.request_timeout_s" if timeout >= s.request_timeout_s
                 else f"what reward.timeout_s={s.timeout_s:g} left")
        return _Failure(f"did not answer within {timeout:.3g} s ({which}; no HTTP status): the service "
                        "is slow or stuck", retry=True)
    if isinstance(reason, ConnectionRefusedError):
        return _Failure("refused the connection (no HTTP status; nothing listens there)", retry=True)
    if isinstance(reason, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                           http.client.IncompleteRead, ConnectionAbortedError)):
        return _Failure(f"closed the connection without a whole answer ({type(reason).__name__}; no HTTP status): "
                        "the service stopped answering", retry=True)
    if isinstance(reason, socket.gaierror):
        return _Failure(f"has a host name that does not resolve ({reason}; no HTTP status)", retry=True)
    return _Failure(f"could not be reached ({type(reason).__name__}: {secrets.scrub_text(str(reason))}; no HTTP status)",
                    retry=True)


class HttpReward:
    """A reward function whose scores come from a reward server (see the module docstring).
    Called by rewards.score as fn(prompts=, completions=, completion_ids=, **columns)."""

    def __init__(self, s: Settings, secret_headers: dict[str, str] | None = None):
        self.settings = s
        self._secret = dict(secret_headers or {})  # never shown, written or logged
        self.needs_columns: frozenset[str] = frozenset()  # what the service's health answer says it reads
        self.last_info: list = []  # the `info` of the last call's completions (None where the service gave none)

    @classmethod
    def from_spec(cls, spec) -> HttpReward:
        return cls(*settings(spec))

    def __repr__(self) -> str:  # no headers: a repr may end up in a log line
        return f"HttpReward({self.settings.public(self.settings.score_path)})"

    # -- the check before any weights load -------------------------------------------------
    def check_service(self) -> None:
        """The service answers its health check (GET health_path, or a POST of zero items when
        health_path is null), with the same retries; RewardServiceError in one line if not. Its
        answer's `columns`, if any, are the row fields every prompt row must carry."""
        s = self.settings
        path = s.health_path or s.score_path
        start = time.monotonic()
        try:
            answer = self._with_retries(lambda t, d: request(s, self._secret, "GET" if s.health_path else "POST", path,
                                                             None if s.health_path else {"items": []}, t, d,
                                                             json_only=not s.health_path),
                                        start + OWN_SHARE * s.timeout_s, threading.Event())
        except _GaveUp as exc:
            raise RewardServiceError(f"reward=http: the reward server is not ready: {s.public(path)} {exc}; start it "
                                     "(e.g. python -m workbench.rollout.reward_server --reward arith_exact --port 8000) "
                                     "or correct reward.url") from None
        if not s.health_path and (not isinstance(answer, dict) or answer.get("scores") != []):
            raise RewardServiceError(f"reward=http: {s.public(path)} answered a zero-item request with "
                                     f"{_excerpt(json.dumps(answer).encode())}; a reward server answers {{\"scores\": []}}")
        cols = answer.get("columns") if isinstance(answer, dict) else None
        if isinstance(cols, list) and all(isinstance(c, str) for c in cols):
            self.needs_columns = frozenset(cols) - {"prompt", "completion"}

    # -- scoring ---------------------------------------------------------------------------
    def __call__(self, prompts, completions, completion_ids=None, max_new_tokens=None, conversations=None,
                 env_reward=None, **columns) -> list[float]:
        n = len(completions)
        if n == 0:
            return []
        s = self.settings
        cols = {k: v for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
        items = [{"prompt": prompts[i], "completion": completions[i], **{k: v[i] for k, v in cols.items()}}
                 for i in range(n)]
        batches = [(i, items[i:i + s.max_batch]) for i in range(0, n, s.max_batch)]
        scores: list = [None] * n
        info: list = [None] * n
        for first, (got, got_info) in self._send_all(batches):
            scores[first:first + len(got)] = got
            info[first:first + len(got)] = got_info
        self.last_info = info
        if s.info_path and any(info):
            self._keep_info(prompts, completions, scores, info)
        return scores

    def _send_all(self, batches: list):
        """(first item, (scores, info)) of every batch (send_all)."""
        s = self.settings

        def one(first, batch, deadline, stop):
            payload = {"items": batch}
            answer = with_retries(s, lambda t, d: request(s, self._secret, "POST", s.score_path, payload, t, d),
                                  deadline, stop)
            return self._scores(answer, batch, first)

        return send_all(s, batches, one, lambda exc, first, batch: self._line(exc, first, len(batch)),
                        f"reward server {s.public(s.score_path)} did not answer all of {len(batches)} requests")

    def _line(self, exc: Exception, first: int, count: int) -> str:
        s = self.settings
        where = f"items {first}-{first + count - 1}" if count > 1 else f"item {first}"
        if isinstance(exc, _GaveUp):
            return f"reward server {s.public(s.score_path)} {exc} (request of {where})"
        return f"{exc} (request of {where})"

    def _with_retries(self, send, deadline: float, stop: threading.Event):
        return with_retries(self.settings, send, deadline, stop)

    def _scores(self, answer, batch: list, first: int) -> tuple[list[float], list]:
        """The answer's scores and info, checked against the protocol; RewardServiceError if not."""
        s = self.settings
        url, n = s.public(s.score_path), len(batch)
        body = _excerpt(json.dumps(answer, default=str).encode())
        where = f"items {first}-{first + n - 1}" if n > 1 else f"item {first}"
        if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
            raise RewardServiceError(f"reward server {url} answered HTTP 200 without a \"scores\" list (request of "
                                     f"{where}): body {body}; a reward server answers {{\"scores\": [...]}}")
        got = answer["scores"]
        if len(got) != n:
            raise RewardServiceError(f"reward server {url} answered HTTP 200 with {len(got)} scores for {n} completions "
                                     f"(request of {where}): body {body}; one score per item, in order")
        values = []
        for i, v in enumerate(got):
            bad = isinstance(v, bool) or not isinstance(v, (int, float))
            if bad or math.isnan(v) or math.isinf(v):
                what = "not a number" if bad else "not finite"
                raise RewardServiceError(f"reward server {url} answered HTTP 200 with score {v!r} ({what}) for item "
                                         f"{first + i} (completion {batch[i]['completion'][:60]!r}): body {body}")
            values.append(float(v))
        info = answer.get("info")
        if info is None:
            return values, [None] * n
        if not isinstance(info, list) or len(info) != n or not all(x is None or isinstance(x, dict) for x in info):
            raise RewardServiceError(f"reward server {url} answered HTTP 200 with an \"info\" that is not a list of "
                                     f"{n} objects or nulls (request of {where}): body {body}")
        return values, info

    def _keep_info(self, prompts, completions, scores, info) -> None:
        keep_info(self.settings.info_path, prompts, completions, scores, info)


def keep_info(info_path: str, prompts, completions, scores, info) -> None:
    """Append each completion's info to info_path (JSONL, secrets scrubbed); one file per rank
    when several train."""
    path = Path(info_path)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    now = datetime.now(UTC).isoformat(timespec="seconds")
    lines = []
    for p, c, v, d in zip(prompts, completions, scores, info):
        if d:
            lines.append(json.dumps(secrets.redact({"time": now, "prompt": prompt_text(p), "completion": c, "score": v,
                                                    "info": d}), default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")


def prompt_text(prompt) -> str:
    """The last message's text of a prompt given as messages, or the prompt string itself."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[-1], dict):
        return str(prompt[-1].get("content", ""))
    return prompt


class _GaveUp(Exception):
    """A request failed for good; the message says how (the URL is added by who reports it)."""


def with_retries(s: Settings, send, deadline: float, stop: threading.Event):
    """send(timeout, deadline) until it answers, at most 1 + retries times, waiting the backoff
    between; _GaveUp naming the last failure and the tries made."""
    for attempt in range(s.retries + 1):
        left = deadline - time.monotonic()
        try:
            return send(min(s.request_timeout_s, max(left, 0.01)), deadline)
        except _Failure as f:
            failure = f
        tries = f"{attempt + 1} of {s.retries + 1} tries"
        if not failure.retry:
            raise _GaveUp(f"{failure.line}; not retried: the service is wrong, not busy")
        if attempt == s.retries:
            raise _GaveUp(f"{failure.line}; {tries} failed ({s.schedule()})")
        wait = min(s.backoff_s * 2**attempt, s.backoff_max_s)
        if failure.wait is not None:
            wait = min(max(wait, failure.wait), s.backoff_max_s)
        if time.monotonic() + wait >= deadline:
            raise _GaveUp(f"{failure.line}; {tries} failed, and reward.timeout_s={s.timeout_s:g} leaves no time "
                          "for another")
        if stop.wait(wait):  # another request failed: this call is over
            raise _GaveUp(f"{failure.line}; stopped retrying after {tries} (another request failed)")
    raise AssertionError("unreachable")


def send_all(s: Settings, jobs: list, one, line, late: str) -> list:
    """(first, one(first, job, deadline, stop)) for every (first, job) of `jobs`: up to
    `concurrency` in flight on daemon threads (a thread stuck in a read must not keep the process
    alive), the first failure ending the whole call at once. A failure (_GaveUp or
    RewardServiceError) becomes RewardServiceError(line(exc, first, job)); a call not done within
    OWN_SHARE of reward.timeout_s, RewardServiceError(`late` + how long it had)."""
    deadline = time.monotonic() + OWN_SHARE * s.timeout_s
    stop, finished, lock = threading.Event(), threading.Event(), threading.Lock()
    todo = list(reversed(jobs))
    done: list = []
    failed: list[str] = []
    running = [min(s.concurrency, len(jobs))]

    def work():
        while not stop.is_set():
            with lock:
                if not todo:
                    return
                first, job = todo.pop()
            try:
                result = one(first, job, deadline, stop)
            except (_GaveUp, RewardServiceError) as exc:
                with lock:
                    failed.append(line(exc, first, job))
                stop.set()
                return
            with lock:
                done.append((first, result))

    def worker():
        try:
            work()
        finally:
            with lock:
                running[0] -= 1
                if running[0] == 0 or failed:
                    finished.set()

    for k in range(running[0]):
        threading.Thread(target=worker, name=f"reward-http-{k}", daemon=True).start()
    # each request's timeout ends by the deadline; a read of a trickling answer may overrun it by
    # one socket timeout, so the wait ends a moment after it whatever the workers do
    finished.wait(max(0.0, deadline - time.monotonic()) + min(1.0, (1 - OWN_SHARE) * s.timeout_s / 2))
    stop.set()  # what is still running ends at its next check, in the background
    with lock:
        if failed:
            raise RewardServiceError(failed[0])
        if len(done) < len(jobs):
            raise RewardServiceError(f"{late} within {OWN_SHARE * s.timeout_s:g} s (reward.timeout_s; no HTTP status): "
                                     "the service is slow or stuck")
        return list(done)
