"""reward=judge: the judge client (workbench/rollout/judge.py) against a small OpenAI-compatible
server made here on the standard library (chat/completions and models), healthy and faulty, in
this process on a free port; and, marked slow, against llama.cpp's own server serving the
packaged SmolLM2-135M-Instruct GGUF on loopback.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_reward_judge.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/unit/test_reward_judge.py   # llama.cpp

The fake judge reads "Proposed answer: X" and "Correct answer: Y" from the rubric and answers
yes (p 0.8) when X == Y, no (p 0.7) otherwise, or a grade 10 / 0 when asked for a number.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from omegaconf import OmegaConf

from tests.conftest import compose, train
from tests.helpers import free_port
from workbench.core.errors import UserError
from workbench.rollout import judge, remote, rewards

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(2, 3), (10, 7), (40, 2)]]
ANSWERS = ["5", "17", "42"]
FAST = {"retries": 2, "backoff_s": 0.05, "request_timeout_s": 2, "timeout_s": 30, "cache_path": None, "info_path": None}


class FakeJudge:
    """An OpenAI-compatible server: GET /v1/models, POST /v1/chat/completions. `logprobs=False`
    answers without log-probabilities; `reply` replaces the text answered; the faults are
    reward_server.py's (delay, first N answered 500, stop answering after N)."""

    def __init__(self, models=("judge",), logprobs=True, reply=None, delay_s=0.0, fail_first=0, port=0):
        self.models, self.logprobs, self.reply = list(models), logprobs, reply
        self.delay_s, self.fail_first = delay_s, fail_first
        self.requests, self.payloads, self.headers = 0, [], []
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, payload: dict) -> dict:
        text = payload["messages"][-1]["content"]
        said = re.search(r"Proposed answer: (.*)", text).group(1).strip()
        right = said == re.search(r"Correct answer: (.*)", text).group(1).strip()
        if payload.get("max_tokens", 16) > 1:  # a grade
            content = self.reply(said) if self.reply else ("Grade: 10" if right else "0")
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        else:
            content = "Yes" if right else "No"
            choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
            if self.logprobs and payload.get("logprobs"):
                yes, no = (0.8, 0.15) if right else (0.2, 0.7)
                top = [{"token": "Yes", "logprob": math.log(yes)}, {"token": " no", "logprob": math.log(no)},
                       {"token": "The", "logprob": math.log(0.05)}][: payload.get("top_logprobs", 3)]
                choice["logprobs"] = {"content": [{"token": content, "logprob": top[0]["logprob"], "top_logprobs": top}]}
        return {"id": "x", "object": "chat.completion", "model": payload.get("model"), "choices": [choice],
                "usage": {"prompt_tokens": 30, "completion_tokens": 1, "total_tokens": 31}}


def _handler(server: FakeJudge):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in server.models]})
            return self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            with server._lock:
                server.requests += 1
                k = server.requests
                server.payloads.append(body)
                server.headers.append(dict(self.headers))
            if server.delay_s:
                time.sleep(server.delay_s)
            if k <= server.fail_first:
                return self._send(503, {"error": f"loading model ({k} of {server.fail_first})"})
            return self._send(200, server.answer(body))

    return Handler


def client(url: str, **fields) -> judge.JudgeReward:
    return judge.JudgeReward.from_spec(OmegaConf.create({"base_url": url, "model": "judge", **FAST, **fields}))


def call(fn, texts, n=None):
    n = len(texts) if n is None else n
    prompts = (PROMPTS * 10)[:n]
    return fn(prompts=prompts, completions=list(texts[:n]), completion_ids=[[1]] * n, answer=(ANSWERS * 10)[:n])


def failure(fn, texts) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(remote.RewardServiceError) as err:
        call(fn, texts)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg, time.monotonic() - t0


# -- scoring -----------------------------------------------------------------------------------------
def test_yes_no_by_log_probabilities():
    with FakeJudge() as server:
        fn = client(server.url)
        assert fn.check_service() == ["judge"]
        got = call(fn, ["5", "16", "42"])
        assert got == pytest.approx([0.8 / 0.95, 0.2 / 0.9, 0.8 / 0.95])
        # the three calls go out concurrently, so the server sees them in any order
        assert all((p["temperature"], p["max_tokens"], p["logprobs"], p["top_logprobs"], p["model"])
                   == (0, 1, True, 10, "judge") for p in server.payloads)
        first = [p["messages"] for p in server.payloads if "2 + 3" in p["messages"][0]["content"]]
        assert first == [[{"role": "user", "content": "Question: What is 2 + 3?\nProposed answer: 5\nCorrect "
                           "answer: 5\nIs the proposed answer correct? Reply with yes or no."}]]
        assert fn.last_info[1]["how"] == "logprobs" and fn.last_info[1]["judge_reply"] == "No"
        assert fn.metrics() == {"judge_calls": 3.0, "judge_cache_hits": 0.0, "judge_tokens": 93.0,
                                "judge_seconds": pytest.approx(fn.metrics()["judge_seconds"]), "judge_unparsed": 0.0}


def test_without_log_probabilities_the_text_is_read_and_said_once(capsys):
    assert judge.has_logprobs({"logprobs": {"content": []}})  # a reply that ended at once: the server can
    assert not judge.has_logprobs({"logprobs": None}) and not judge.has_logprobs({})
    assert judge.yes_probability({"logprobs": {"top_logprobs": [{" YES": math.log(0.3), "No.": math.log(0.1)}]}}) \
        == pytest.approx(0.75)  # the completions API's shape
    assert judge.text_yes_no("Yes, it is.") == 1.0 and judge.text_yes_no(" no") == 0.0 and judge.text_yes_no("?") is None
    with FakeJudge(logprobs=False) as server:
        fn = client(server.url)
        assert call(fn, ["5", "16", "42"]) == [1.0, 0.0, 1.0]
        assert call(fn, ["6", "17"]) == [0.0, 1.0]
    err = capsys.readouterr().err
    assert err.count("returned no log-probabilities") == 1, err
    assert (f"warning: reward=judge: the judge server at {server.url} returned no log-probabilities; reward.score=yes_no "
            "reads each reply's text instead (yes 1, no 0)") in err


def test_a_number_in_the_range_is_mapped_to_0_1():
    assert judge.parse_number("Grade: 7", 0, 10) == 0.7 and judge.parse_number("-1", -1, 1) == 0.0
    assert judge.parse_number("12 out of 10", 0, 10) is None and judge.parse_number("no idea", 0, 10) is None
    assert judge.parse_number("3.5/5", 1, 5) == pytest.approx(0.625)
    with FakeJudge() as server:
        fn = client(server.url, score="number")
        assert call(fn, ["5", "16", "42"]) == [1.0, 0.0, 1.0]
        assert server.payloads[0]["max_tokens"] == 8 and "logprobs" not in server.payloads[0]
        assert "Grade the proposed answer from 0" in server.payloads[0]["messages"][0]["content"]


def test_unparsed_replies_get_the_configured_score_then_stop_the_run(capsys):
    with FakeJudge(reply=lambda said: "I cannot tell" if said == "?" else "10") as server:
        fn = client(server.url, score="number", unparsed_score=0.25, max_unparsed_share=0.5)
        assert call(fn, ["5", "?", "42"]) == [1.0, 0.25, 1.0]
        assert fn.metrics()["judge_unparsed"] == 1.0
        assert ("warning: reward=judge: no score in 1 of 3 replies (each given reward.unparsed_score=0.25), e.g. reply "
                "'I cannot tell' to completion '?'") in capsys.readouterr().err
        msg, _ = failure(fn, ["?", "? ", "42"])
    assert msg == ("reward=judge: no score in 2 of 3 replies (more than reward.max_unparsed_share=0.5), e.g. reply "
                   "'I cannot tell' to completion '?'; the rubric must ask for a number in [0, 10], or the model "
                   "cannot follow it")


def test_the_cache_asks_each_question_once_in_memory_and_on_disk(tmp_path):
    path = tmp_path / "samples" / "judge_cache.jsonl"
    with FakeJudge() as server:
        fn = client(server.url, cache_path=str(path))
        first = call(fn, ["5", "5", "16"], 3)  # prompts 0, 1, 2: three questions
        assert server.requests == 3
        again = call(fn, ["5", "5", "5", "5"], 4)  # prompts 0, 1, 2, 0: (0, "5") and (1, "5") are cached
        assert server.requests == 4 and again[:2] == first[:2] and again[3] == first[0]
        assert fn.metrics()["judge_calls"] == 1.0 and fn.metrics()["judge_cache_hits"] == 3.0
        call(fn, ["9", "9", "9", "9"], 4)  # a repeat within one batch is asked once
        assert server.requests == 7 and fn.metrics()["judge_calls"] == 3.0 and fn.last_info[3]["cached"]
        assert fn.totals["calls"] == 7 and fn.totals["cache_hits"] == 3
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        assert len(rows) == 7 and set(rows[0]) == {"key", "score", "reply", "how", "tokens"}
        resumed = client(server.url, cache_path=str(path))  # a resumed run reads the file back
        assert call(resumed, ["5", "5", "16"], 3) == first and server.requests == 7
        other = client(server.url, cache_path=str(path), model="judge-2")  # another model: asked again
        call(other, ["5"], 1)
        assert server.requests == 8
    with pytest.raises(remote.RewardServiceError, match="ConnectionRefused|refused"):  # nothing cached survives
        call(client(server.url, retries=0), ["7"], 1)


# -- the checks before any weights load ---------------------------------------------------------
def test_a_model_the_server_does_not_serve_is_named_with_what_it_serves():
    with FakeJudge(models=["smollm2", "gemma3"]) as server:
        fns = rewards.resolve(OmegaConf.create({"functions": ["judge"], "base_url": server.url, "model": "judge",
                                                **FAST}))
        with pytest.raises(remote.RewardServiceError) as err:
            rewards.check_columns(fns, [("rows.jsonl:1", {"prompt": "p", "answer": "1"})])
    assert str(err.value) == (f"reward=judge: the judge server at {server.url} does not serve model 'judge'; it serves "
                              "['smollm2', 'gemma3']: set reward.model to one of them (llama.cpp's server: name it "
                              "with --model_alias)")


def test_rubric_fields_are_required_columns():
    with FakeJudge() as server:
        rubric = "Q: {prompt}\nA: {completion}\nSource: {source}\nExpected: {answer}\nyes or no?"
        fns = rewards.resolve(OmegaConf.create({"functions": ["judge"], "base_url": server.url, "model": "judge",
                                                "rubric": rubric, **FAST}))
        assert rewards.required_columns(fns[0].fn) == {"answer", "source"}
        with pytest.raises(UserError, match=r"rows.jsonl:2: reward function 'judge' needs the column\(s\) "
                                            r"\['source'\], which this prompt row does not have"):
            rewards.check_columns(fns, [("rows.jsonl:1", {"prompt": "p", "answer": "1", "source": "s"}),
                                        ("rows.jsonl:2", {"prompt": "q", "answer": "2"})])


@pytest.mark.parametrize("fields, expect", [
    ({"base_url": None}, r"reward=judge needs reward.base_url"),
    ({"model": None}, r"reward=judge needs reward.model"),
    ({"score": "stars"}, r"reward.score=stars: choose yes_no"),
    ({"rubric": "{prompt} {0}"}, r"the field \{0\} is not a column name"),
    ({"rubric": "Is {prompt} right?"}, r"never shows the judge the \{completion\}"),
    ({"rubric": "{completion"}, r"reward.rubric: not a template"),
    ({"score": "number", "low": 5, "high": 1}, r"reward.high=1.0: must be > reward.low=5"),
    ({"base_url": "http://u:pw9876543210@h/v1"}, r"reward.base_url=http://h/v1: a user or password"),
    ({"headers": {"Authorization": "Bearer x"}}, r"reward.headers.Authorization: a secret"),
])
def test_bad_settings_are_one_line(fields, expect):
    node = {"functions": ["judge"], "base_url": "http://127.0.0.1:9/v1", "model": "judge", **fields}
    with pytest.raises(UserError, match=expect) as err:
        rewards.resolve(OmegaConf.create(node))
    assert "\n" not in str(err.value) and "pw9876543210" not in str(err.value)


def test_the_config_node_composes_and_resolves(tmp_path):
    cfg = compose(["method=grpo", "reward=judge", "reward.base_url=http://127.0.0.1:9/v1"], tmp_path)
    fn = rewards.resolve(cfg.reward)[0].fn
    assert isinstance(fn, judge.JudgeReward) and fn.needs_columns == {"answer"}
    assert (fn.judge.model, fn.judge.score, fn.settings.retries, fn.settings.concurrency) == ("judge", "yes_no", 3, 4)
    assert fn.cache.path == tmp_path / "samples" / "judge_cache.jsonl"
    assert judge.estimate(cfg.reward, 32) == {"calls": 32, "tokens": 32 * (len(judge.RUBRICS["yes_no"]) // 4 + 57),
                                              "concurrency": 4}
    assert judge.plan_line(cfg.reward, 32, seconds_per_call=0.25).startswith(
        "judge: at most 32 calls per step (one per completion, fewer as the cache fills), ~")
    assert judge.plan_line(cfg.reward, 32, seconds_per_call=0.25).endswith(
        "4 at a time, model 'judge' at http://127.0.0.1:9/v1; ~2 s per step at 0.25 s per call")
    # ceil(32 calls / 4 at a time) x 0.25 s = 2 s a step; 100 steps: 200 s
    assert judge.plan_line(cfg.reward, 32, 0.25, steps=100).endswith("at most 3.33 min over 100 steps")


def test_the_plan_counts_the_judge(tmp_path):
    """A dry run's plan holds the judge's calls per step (the tiny config's GRPO step: 8
    completions), and with reward.seconds_per_call the seconds: ceil(8 / 4 at a time) x 0.5 s = 1 s
    a step, 10 s over 10 steps; no note without a judge."""
    from workbench.plan.make import make_plan

    base = ["method=grpo", "reward=judge", "reward.base_url=http://127.0.0.1:9/v1", "train.max_steps=10"]
    notes = make_plan(compose([*base, "reward.seconds_per_call=0.5"], tmp_path), others=False)["notes"]
    line = next(n for n in notes if n.startswith("judge: "))
    assert "at most 8 calls per step" in line and "~1 s per step at 0.5 s per call" in line and "0.167 min" in line
    assert not any(n.startswith("judge: ") for n in make_plan(compose(["method=grpo"], tmp_path), others=False)["notes"])


def test_the_token_reaches_the_server_and_nothing_else(monkeypatch, capsys):
    token = "jt-5e4d3c2b1a0f9e8d7c6b"
    monkeypatch.setenv("MY_JUDGE_CRED", token)
    with FakeJudge() as server:
        fn = client(server.url, headers_from_env={"Authorization": "Bearer $MY_JUDGE_CRED"})
        fn.check_service()
        call(fn, ["5"], 1)
        assert server.headers[0]["Authorization"] == f"Bearer {token}"
    assert token not in repr(fn) and token not in repr(fn.settings) and token not in capsys.readouterr().err


# -- faults (reward=http's machinery) --------------------------------------------------------------
def test_5xx_is_retried_with_backoff():
    with FakeJudge(fail_first=2) as server:
        assert call(client(server.url, retries=3, backoff_s=0.05, concurrency=1), ["5"], 1) == [pytest.approx(0.8 / 0.95)]
        assert server.requests == 3
    with FakeJudge(fail_first=100) as server:
        msg, took = failure(client(server.url, retries=1, backoff_s=0.05, concurrency=1), ["5"])
    assert msg == (f"judge server {server.url}/chat/completions answered HTTP 503 Service Unavailable: body "
                   "'{\"error\": \"loading model (2 of 100)\"}'; 2 of 2 tries failed (1 retry, backoff 0.05 s doubling "
                   "up to 30 s) (request for completion 0)")
    assert took < 2


def test_a_slow_judge_is_named_and_bounded():
    with FakeJudge(delay_s=2.0) as server:
        msg, took = failure(client(server.url, request_timeout_s=0.3, retries=1), ["5"])
    assert msg.startswith(f"judge server {server.url}/chat/completions did not answer within 0.3 s "
                          "(reward.request_timeout_s; no HTTP status): the service is slow or stuck; 2 of 2 tries "
                          "failed"), msg
    assert took < 2 * 0.3 + 0.05 + 1.0


def test_down_at_start_fails_before_weights_in_one_line(tmp_path, monkeypatch):
    import workbench.models.build as build

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the judge server was checked")

    monkeypatch.setattr(build, "load_model", no_weights)
    port = free_port()
    with pytest.raises(remote.RewardServiceError) as err:
        train(["method=grpo", "reward=judge", f"reward.base_url=http://127.0.0.1:{port}/v1", "reward.retries=1",
               "reward.backoff_s=0.05", "train.max_steps=1"], tmp_path)
    assert str(err.value) == (f"reward=judge: the judge server is not ready: http://127.0.0.1:{port}/v1/models refused "
                              "the connection (no HTTP status; nothing listens there); 2 of 2 tries failed (1 retry, "
                              "backoff 0.05 s doubling up to 30 s); start one (e.g. python -m llama_cpp.server --model "
                              "<file.gguf> --model_alias judge --port 8080) or correct reward.base_url")


def test_grpo_trains_on_the_judge(tmp_path, capsys):
    """Two GRPO steps of the tiny model with the fake judge as the reward, through the run: the
    judge's line as the run starts, and each step's calls, cache hits and seconds in its row."""
    with FakeJudge() as server:
        out = train(["method=grpo", "reward=judge", f"reward.base_url={server.url}", "train.max_steps=2",
                     "train.resume=never", "method.log_completions=0", "train.log_every=1"], tmp_path)
        assert server.requests >= 1 and len(out["losses"]) == 2
    assert "judge: at most " in capsys.readouterr().err
    steps = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]
    assert len(steps) == 2 and all(r["judge_calls"] + r["judge_cache_hits"] >= 1 for r in steps)
    # every call the server answered is one step's judge_calls (the cache asks each question once)
    assert sum(r["judge_calls"] for r in steps) == server.requests and all(r["judge_seconds"] >= 0 for r in steps)
    rows = (tmp_path / "samples" / "judge_cache.jsonl").read_text().splitlines()
    assert rows and all(0.0 <= json.loads(r)["score"] <= 1.0 for r in rows)


# -- llama.cpp's server ------------------------------------------------------------------------------
@contextlib.contextmanager
def llama_server(gguf, alias="judge"):
    """llama-cpp-python's OpenAI-compatible server on a free loopback port, until it answers
    GET /v1/models; (url, seconds it took to start)."""
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", alias,
                             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "1",
                             "--verbose", "false"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"llama_cpp.server exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/models", timeout=1).read()
                break
            except OSError:
                if time.monotonic() - t0 > 120:
                    raise
                time.sleep(0.1)
        yield url, time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_a_packaged_model_served_by_llama_cpp_judges():
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")
    gguf = judge.packaged_gguf("smollm2-135m")
    with llama_server(gguf) as (url, started):
        print(f"llama_cpp.server started in {started:.2f} s")
        fn = client(url, request_timeout_s=60, timeout_s=120)
        assert fn.check_service() == ["judge"]
        texts = ["5", "16", "42", "banana"]
        scores = call(fn, texts, 3)
        assert all(0.0 <= s <= 1.0 for s in scores)
        assert [i["how"] for i in fn.last_info] == ["logprobs"] * 3  # the server returns top log-probabilities
        assert fn.metrics()["judge_calls"] == 3 and fn.metrics()["judge_tokens"] > 0
        assert call(fn, texts, 3) == scores and fn.metrics()["judge_cache_hits"] == 3
        graded = client(url, score="number", request_timeout_s=60, timeout_s=120, max_unparsed_share=1.0)
        assert all(0.0 <= s <= 1.0 for s in call(graded, texts, 3))
        with pytest.raises(remote.RewardServiceError, match="does not serve model 'gpt-4'; it serves \\['judge'\\]"):
            client(url, model="gpt-4").check_service()
