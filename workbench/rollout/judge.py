"""`reward=judge`: GRPO rewards from a judge model behind any OpenAI-compatible chat endpoint
(llama.cpp's server, vLLM, Ollama, a hosted API).

    python -m llama_cpp.server --model <file.gguf> --model_alias judge --port 8080 &
    python -m workbench method=grpo reward=judge reward.base_url=http://127.0.0.1:8080/v1 reward.model=judge
    python -m workbench method=grpo reward=judge reward.score=number           # a 0-10 grade instead of yes/no

Each completion's row is written into `reward.rubric` (a str.format template over the row's
fields: `{prompt}` is the last prompt message's text, `{completion}` the completion, any other
name a column of the prompt row, such as `{answer}`, which every training and held-out row must
then carry: rewards.check_columns checks it before any weights load) and sent as one chat request

    POST <base_url>/chat/completions  {"model": ..., "messages": [{"role": "user", "content": <rubric>}],
                                       "temperature": 0, "max_tokens": ..., ["logprobs": true, "top_logprobs": k]}

and the reply is read as a score in [0, 1]:

- `score: yes_no`: the probability of "yes" among the first token's top log-probabilities,
  p(yes) / (p(yes) + p(no)) over the tokens that read "yes" or "no" whatever their case and
  spaces (one token is asked for: max_tokens 1). A server that returns no log-probabilities is
  said once; its reply's text is read instead (yes 1, no 0).
- `score: number`: the first number in the reply, in [low, high], mapped linearly to [0, 1].

A reply with no score gets `unparsed_score` and is counted and logged; more than
`max_unparsed_share` of a batch unread stops the run in one line (the rubric or the model is
wrong, not the service busy). The HTTP side is reward=http's (workbench/rollout/remote.py): the
same timeouts, retries with backoff, concurrency limit, `headers_from_env` secrets and one-line
RewardServiceError messages. Before any weights load the server is asked GET <base_url>/models;
a server that is down, or does not serve `model` (the names it does serve are said), fails there.

Answers are cached by (model, the rubric written with the row: prompt, completion and the fields
it names, the scoring): a completion asked twice (GRPO's groups repeat the short ones) is asked
once. The cache lives in memory and, with `cache_path`, in a JSON-lines file under the run
directory that a resumed run reads back. `metrics()` gives the last call's counts (calls, cache
hits, tokens, seconds, unparsed replies) for the step's log; `estimate()` what a step will cost,
for the plan.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
import re
import string
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from workbench.core import secrets
from workbench.core.errors import UserError
from workbench.models import load
from workbench.rollout import remote
from workbench.rollout.remote import RewardServiceError

SCORES = ("yes_no", "number")
# The rubric when reward.rubric is null, for each scoring: both compare with the row's `answer`.
RUBRICS = {
    "yes_no": ("Question: {prompt}\nProposed answer: {completion}\nCorrect answer: {answer}\n"
               "Is the proposed answer correct? Reply with yes or no."),
    "number": ("Question: {prompt}\nProposed answer: {completion}\nCorrect answer: {answer}\n"
               "Grade the proposed answer from 0 (wrong) to 10 (exactly the correct answer). Reply with the grade only."),
}
ROW_FIELDS = frozenset({"prompt", "completion"})  # given by every call; any other field is a column
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_WORD = re.compile(r"[a-z]+")


@dataclass(frozen=True)
class Judge:
    model: str
    rubric: str
    fields: frozenset  # the names the rubric reads
    score: str = "yes_no"
    low: float = 0.0
    high: float = 10.0
    unparsed_score: float = 0.0
    max_unparsed_share: float = 0.5
    top_logprobs: int = 10
    max_tokens: int = 1
    system: str | None = None
    cache_path: str | None = None
    info_path: str | None = None


def rubric_fields(rubric: str) -> frozenset:
    """The field names a rubric reads; UserError for a template str.format cannot fill from a row."""
    try:
        parts = list(string.Formatter().parse(rubric))
    except ValueError as exc:
        raise UserError(f"reward.rubric: not a template ({exc}); write fields as {{answer}} and a literal brace "
                        "as {{ or }}") from None
    names = set()
    for _, name, _, _ in parts:
        if name is None:
            continue
        if not name.isidentifier():
            raise UserError(f"reward.rubric: the field {{{name}}} is not a column name; name a row field, "
                            "e.g. {prompt}, {completion}, {answer}")
        names.add(name)
    if "completion" not in names:
        raise UserError("reward.rubric: it never shows the judge the {completion}; put {completion} in it")
    return frozenset(names)


def _number(spec, key, default, check, need, kind=float):
    return remote._field(spec, key, default, kind, check, need)


def settings(spec) -> tuple[remote.Settings, Judge, dict[str, str]]:
    """The HTTP settings (reward=http's), the judge's own and the headers read from the
    environment, from the reward node; UserError naming the field that is wrong."""
    get = spec.get if hasattr(spec, "get") else {}.get
    url = get("base_url")
    if not url or str(url) in ("None", "null"):
        raise UserError("reward=judge needs reward.base_url: an OpenAI-compatible server's base URL, e.g. "
                        "reward.base_url=http://127.0.0.1:8080/v1 (python -m llama_cpp.server --model <file.gguf> "
                        "--model_alias judge --port 8080 serves one)")
    model = get("model")
    if not model or str(model) in ("None", "null"):
        raise UserError("reward=judge needs reward.model: the model name the server serves (GET <base_url>/models "
                        "lists them)")
    score = str(get("score", "yes_no"))
    if score not in SCORES:
        raise UserError(f"reward.score={score}: choose yes_no (log-probabilities of yes) or number (a number in "
                        "[reward.low, reward.high])")
    rubric = get("rubric")
    rubric = RUBRICS[score] if rubric is None or str(rubric) in ("", "None", "null") else str(rubric)
    low = _number(spec, "low", 0.0, math.isfinite, "a finite number")
    high = _number(spec, "high", 10.0, lambda v: math.isfinite(v) and v > low, f"> reward.low={low:g}")
    judge = Judge(
        model=str(model), rubric=rubric, fields=rubric_fields(rubric), score=score, low=low, high=high,
        unparsed_score=_number(spec, "unparsed_score", 0.0, lambda v: 0 <= v <= 1, "in [0, 1]"),
        max_unparsed_share=_number(spec, "max_unparsed_share", 0.5, lambda v: 0 <= v <= 1, "in [0, 1]"),
        top_logprobs=_number(spec, "top_logprobs", 10, lambda v: 1 <= v <= 20, "in [1, 20]", int),
        max_tokens=1 if score == "yes_no" else _number(spec, "max_tokens", 8, lambda v: v >= 1, ">= 1", int),
        system=remote._path(get("system")), cache_path=remote._path(get("cache_path")),
        info_path=remote._path(get("info_path")))
    s = remote.Settings(url=remote.check_url(url, "base_url"), score_path="/chat/completions", health_path="/models",
                        **remote.client_fields(spec))
    return s, judge, remote.env_headers(get("headers_from_env") or {})


# -- reading a reply ---------------------------------------------------------------------------
def parse_number(text: str, low: float, high: float) -> float | None:
    """The first number in `text` mapped from [low, high] to [0, 1]; None when there is none or
    it is out of the range (a judge that grades 0-10 and says 12 has not followed the rubric)."""
    m = _NUMBER.search(text or "")
    if not m:
        return None
    x = float(m.group())
    return (x - low) / (high - low) if low <= x <= high else None


def _word(token: str) -> str:
    return token.strip().lower().strip(".,!:;\"'*")


def yes_probability(choice: dict) -> float | None:
    """p(yes) / (p(yes) + p(no)) over the first generated token's top log-probabilities, in
    either of the shapes servers return (chat: logprobs.content[0].top_logprobs as a list of
    {token, logprob}; completions: logprobs.top_logprobs[0] as {token: logprob}). None when the
    choice has no log-probabilities, or neither word is among them."""
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    if not isinstance(lp, dict):
        return None
    pairs: list = []
    content = lp.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        top = content[0].get("top_logprobs") or []
        pairs = [(t.get("token", ""), t.get("logprob")) for t in top if isinstance(t, dict)]
    elif isinstance(lp.get("top_logprobs"), list) and lp["top_logprobs"] and isinstance(lp["top_logprobs"][0], dict):
        pairs = list(lp["top_logprobs"][0].items())
    mass = {"yes": 0.0, "no": 0.0}
    for token, logprob in pairs:
        w = _word(str(token))
        if w in mass and isinstance(logprob, (int, float)) and math.isfinite(logprob):
            mass[w] += math.exp(logprob)
    total = mass["yes"] + mass["no"]
    return mass["yes"] / total if total > 0 else None


def has_logprobs(choice: dict) -> bool:
    """Whether the server returned log-probabilities at all (an empty list, for a reply that
    ended at once, counts: the server can, this reply had no token)."""
    lp = choice.get("logprobs") if isinstance(choice, dict) else None
    return isinstance(lp, dict) and (isinstance(lp.get("content"), list) or isinstance(lp.get("top_logprobs"), list))


def text_yes_no(text: str) -> float | None:
    """1 when the reply's first word is yes, 0 when it is no, else None."""
    m = _WORD.search((text or "").lower())
    return {"yes": 1.0, "no": 0.0}.get(m.group()) if m else None


# -- the cache -----------------------------------------------------------------------------------
class Cache:
    """Judge answers by key, in memory and, with a path, appended to a JSON-lines file (read back
    when it exists: a resumed run does not ask again). JSON only: the file holds data, never code."""

    def __init__(self, path: str | None = None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._memory: dict[str, dict] = {}
        if self.path is not None:
            world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
            if world > 1:  # one file per rank: no two processes append to one file
                self.path = self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                        self._memory[row["key"]] = row
                    except (ValueError, KeyError, TypeError):  # a line cut by a killed run: asked again
                        continue

    def __len__(self) -> int:
        return len(self._memory)

    def get(self, key: str) -> dict | None:
        with self._lock:
            return self._memory.get(key)

    def put(self, rows: list[dict]) -> None:
        with self._lock:
            for row in rows:
                self._memory[row["key"]] = row
            if self.path is not None and rows:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write("".join(json.dumps(secrets.redact(r)) + "\n" for r in rows))


def cache_key(judge: Judge, message: str) -> str:
    """The key of one question: the model, the rubric as written for this row (so the prompt,
    the completion and every field it names) and how the reply is scored."""
    raw = json.dumps([judge.model, judge.system, message, judge.score, judge.low, judge.high, judge.top_logprobs,
                      judge.max_tokens])
    return hashlib.sha256(raw.encode()).hexdigest()


# -- the reward ----------------------------------------------------------------------------------
class JudgeReward:
    """A reward function whose scores a judge model gives (see the module docstring). Called by
    rewards.score as fn(prompts=, completions=, completion_ids=, **columns)."""

    def __init__(self, s: remote.Settings, judge: Judge, secret_headers: dict[str, str] | None = None):
        self.settings, self.judge = s, judge
        self._secret = dict(secret_headers or {})  # never shown, written or logged
        self.needs_columns = judge.fields - ROW_FIELDS  # checked on every prompt row before weights load
        self.cache = Cache(judge.cache_path)
        self.last_info: list = []
        self.totals = {"calls": 0, "cache_hits": 0, "tokens": 0, "seconds": 0.0, "unparsed": 0}
        self._last = dict(self.totals)
        self._said_no_logprobs = False

    @classmethod
    def from_spec(cls, spec) -> JudgeReward:
        return cls(*settings(spec))

    def plan_line(self, completions_per_step: int) -> str:
        """The plan's line (plan_line below) for this judge, printed as a GRPO run starts."""
        j = self.judge
        return plan_line({"score": j.score, "rubric": j.rubric, "max_tokens": j.max_tokens, "model": j.model,
                          "concurrency": self.settings.concurrency, "base_url": self.settings.url},
                         completions_per_step)

    def __repr__(self) -> str:  # no headers: a repr may end up in a log line
        return f"JudgeReward({self.judge.model!r} at {self.settings.public('')})"

    # -- the check before any weights load -------------------------------------------------------
    def check_service(self) -> list[str]:
        """GET <base_url>/models answers, and lists `model` when it lists names; the names it
        serves. RewardServiceError in one line if not."""
        s = self.settings
        start = time.monotonic()
        try:
            answer = remote.with_retries(s, lambda t, d: remote.request(s, self._secret, "GET", "/models", None, t, d,
                                                                        json_only=False),
                                         start + remote.OWN_SHARE * s.timeout_s, threading.Event())
        except remote._GaveUp as exc:
            raise RewardServiceError(f"reward=judge: the judge server is not ready: {s.public('/models')} {exc}; start "
                                     "one (e.g. python -m llama_cpp.server --model <file.gguf> --model_alias judge "
                                     "--port 8080) or correct reward.base_url") from None
        data = answer.get("data") if isinstance(answer, dict) else None
        names = [str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id")] if isinstance(data, list) else []
        if names and self.judge.model not in names:
            raise RewardServiceError(f"reward=judge: the judge server at {s.public('')} does not serve model "
                                     f"{self.judge.model!r}; it serves {names[:10]}{' ...' if len(names) > 10 else ''}: "
                                     "set reward.model to one of them (llama.cpp's server: name it with --model_alias)")
        return names

    # -- scoring -----------------------------------------------------------------------------------
    def message(self, prompt, completion: str, row: dict) -> str:
        values = {**row, "prompt": remote.prompt_text(prompt), "completion": completion}
        missing = sorted(self.judge.fields - set(values))
        if missing:
            # RewardServiceError: rewards.score passes it on, without asking the judge sample by sample
            raise RewardServiceError(f"reward=judge: reward.rubric reads {missing}, which the prompt row does not have "
                            f"(keys: {sorted(values)}); add them to every row or change the rubric")
        return self.judge.rubric.format(**{k: values[k] for k in self.judge.fields})

    def __call__(self, prompts, completions, completion_ids=None, max_new_tokens=None, conversations=None,
                 env_reward=None, **columns) -> list[float]:
        n = len(completions)
        self._last = {"calls": 0, "cache_hits": 0, "tokens": 0, "seconds": 0.0, "unparsed": 0}
        if n == 0:
            self.last_info = []
            return []
        t0 = time.monotonic()
        cols = {k: v for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == n}
        messages = [self.message(prompts[i], completions[i], {k: v[i] for k, v in cols.items()}) for i in range(n)]
        keys = [cache_key(self.judge, m) for m in messages]
        answers: dict[str, dict] = {}
        todo: dict[str, tuple[int, str]] = {}  # key -> (first completion with it, its message)
        for i, (k, m) in enumerate(zip(keys, messages)):
            hit = self.cache.get(k)
            if hit is not None:
                answers[k] = hit
            elif k not in todo:
                todo[k] = (i, m)
        hits = sum(k in answers for k in keys)  # a repeat within this batch is asked once but is no hit
        if todo:
            jobs = [(i, (k, m)) for k, (i, m) in todo.items()]
            got = remote.send_all(self.settings, jobs, self._ask, self._line,
                                  f"judge server {self.settings.public('/chat/completions')} did not answer all of "
                                  f"{len(jobs)} requests")
            rows = [row for _, row in got]
            self.cache.put(rows)
            answers.update({row["key"]: row for row in rows})
            self._last["tokens"] = sum(row.get("tokens", 0) for row in rows)
        scores, info, unread = [], [], []
        for i, k in enumerate(keys):
            row = answers[k]
            value = row["score"]
            if value is None:
                unread.append(i)
                value = self.judge.unparsed_score
            scores.append(float(value))
            info.append({"judge_reply": row.get("reply", ""), "judge_score": row["score"], "cached": k not in todo
                         or todo[k][0] != i, "how": row.get("how")})
        self._last.update(calls=len(todo), cache_hits=hits, seconds=time.monotonic() - t0, unparsed=len(unread))
        for key in self.totals:
            self.totals[key] += self._last[key]
        self.last_info = info
        if unread:
            self._unread(unread, completions, answers, keys)
        if self.judge.info_path:
            remote.keep_info(self.judge.info_path, prompts, completions, scores, info)
        return scores

    def _ask(self, first: int, job: tuple[str, str], deadline: float, stop: threading.Event) -> dict:
        """One chat request for the question `job` = (key, message); the cache row of its answer."""
        key, message = job
        j, s = self.judge, self.settings
        payload = {"model": j.model, "temperature": 0, "max_tokens": j.max_tokens,
                   "messages": ([{"role": "system", "content": j.system}] if j.system else [])
                   + [{"role": "user", "content": message}]}
        if j.score == "yes_no":
            payload.update(logprobs=True, top_logprobs=j.top_logprobs)
        answer = remote.with_retries(s, lambda t, d: remote.request(s, self._secret, "POST", "/chat/completions",
                                                                    payload, t, d), deadline, stop)
        try:
            choice = answer["choices"][0]
            reply = choice["message"]["content"]
            reply = "" if reply is None else str(reply)
        except (KeyError, IndexError, TypeError):
            raise RewardServiceError(f"judge server {s.public('/chat/completions')} answered HTTP 200 without "
                                     "choices[0].message.content: body "
                                     f"{remote._excerpt(json.dumps(answer, default=str).encode())}; not an "
                                     "OpenAI-compatible chat answer") from None
        usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
        tokens = usage.get("total_tokens") if isinstance(usage.get("total_tokens"), int) else 0
        if j.score == "number":
            value, how = parse_number(reply, j.low, j.high), "number"
        else:
            value, how = yes_probability(choice), "logprobs"
            if value is None:
                if reply.strip() and not has_logprobs(choice):  # an empty reply has no token to have them for
                    self._say_no_logprobs()
                value, how = text_yes_no(reply), "text"
        return {"key": key, "score": value, "reply": reply[:200], "how": how, "tokens": tokens}

    def _line(self, exc: Exception, first: int, job) -> str:
        where = f"request for completion {first}"
        if isinstance(exc, remote._GaveUp):
            return f"judge server {self.settings.public('/chat/completions')} {exc} ({where})"
        return f"{exc} ({where})"

    def _say_no_logprobs(self) -> None:
        if not self._said_no_logprobs:
            self._said_no_logprobs = True
            _warn(f"reward=judge: the judge server at {self.settings.public('')} returned no log-probabilities; "
                  "reward.score=yes_no reads each reply's text instead (yes 1, no 0)")

    def _unread(self, unread: list[int], completions, answers: dict, keys: list[str]) -> None:
        j, n = self.judge, len(completions)
        i = unread[0]
        example = f"reply {answers[keys[i]].get('reply', '')[:80]!r} to completion {completions[i][:40]!r}"
        want = f"a number in [{j.low:g}, {j.high:g}]" if j.score == "number" else "yes or no"
        if len(unread) > j.max_unparsed_share * n:
            raise RewardServiceError(f"reward=judge: no score in {len(unread)} of {n} replies (more than "
                                     f"reward.max_unparsed_share={j.max_unparsed_share:g}), e.g. {example}; the rubric "
                                     f"must ask for {want}, or the model cannot follow it")
        _warn(f"reward=judge: no score in {len(unread)} of {n} replies (each given reward.unparsed_score="
              f"{j.unparsed_score:g}), e.g. {example}")

    def metrics(self) -> dict[str, float]:
        """The last call's counts, for the step's log: judge calls made, cache hits, tokens the
        server counted, seconds, and replies with no score."""
        return {f"judge_{k}": float(v) for k, v in self._last.items()}


def _warn(line: str) -> None:
    print(f"warning: {secrets.scrub_text(line)}", file=sys.stderr, flush=True)


# -- the plan --------------------------------------------------------------------------------------
def estimate(spec, completions_per_step: int, seconds_per_call: float | None = None,
             prompt_tokens: int = 40, completion_tokens: int = 16) -> dict:
    """What a GRPO step asks of the judge, at most: one call per completion (nothing cached yet:
    a repeated completion costs nothing, so this is an upper bound), the tokens those calls
    send and read, and with `seconds_per_call` the seconds, `concurrency` calls at a time."""
    get = spec.get if hasattr(spec, "get") else {}.get
    score = str(get("score", "yes_no"))
    rubric = get("rubric")
    rubric = RUBRICS.get(score, "") if rubric is None or str(rubric) in ("", "None", "null") else str(rubric)
    concurrency = max(1, int(get("concurrency", 4) or 4))
    reply = 1 if score == "yes_no" else int(get("max_tokens", 8) or 8)
    per_call = len(rubric) // 4 + prompt_tokens + completion_tokens + reply  # ~4 characters a token
    calls = int(completions_per_step)
    out = {"calls": calls, "tokens": calls * per_call, "concurrency": concurrency}
    if seconds_per_call is not None:
        out["seconds"] = math.ceil(calls / concurrency) * seconds_per_call
    return out


def plan_line(spec, completions_per_step: int, seconds_per_call: float | None = None, steps: int | None = None) -> str:
    """The planner's line for a reward=judge run; with `steps`, the seconds of the whole run too."""
    e = estimate(spec, completions_per_step, seconds_per_call)
    get = spec.get if hasattr(spec, "get") else {}.get
    where = remote.public_url(str(get("base_url") or "?"))
    line = (f"judge: at most {e['calls']} calls per step (one per completion, fewer as the cache fills), "
            f"~{e['tokens']:,} tokens, {e['concurrency']} at a time, model {get('model')!r} at {where}")
    if "seconds" not in e:
        return line
    whole = f", at most {e['seconds'] * steps / 60:.3g} min over {steps} steps" if steps else ""
    return line + f"; ~{e['seconds']:.3g} s per step at {seconds_per_call:g} s per call{whole}"


# -- a packaged model as the judge ------------------------------------------------------------------
def packaged_gguf(name: str) -> Path:
    """The GGUF file a packaged model (conf/model/<name>.yaml's gguf_package) ships, joined from
    its parts first where it ships in parts; UserError when the package is not installed. Never
    downloads: the file is the package's."""
    cfg = load.zoo_entry(name)
    package = cfg.get("gguf_package") if hasattr(cfg, "get") else None
    path = load._gguf_in_package(package) if package else None
    if path is None:
        raise UserError(f"model {name}: no packaged GGUF here ({load._install_hint(package) if package else 'none'})")
    if not path.exists():
        importlib.import_module(package).assemble(path)
    return path
