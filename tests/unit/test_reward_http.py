"""reward=http: the reward server client (workbench/rollout/remote.py) against the reference server
(workbench/rollout/reward_server.py) healthy and faulty, in this process on a free port.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_reward_http.py
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -m slow tests/unit/test_reward_http.py   # the CLI's lines

Every failure is one line naming the URL, the status (where there was one) and a body excerpt;
every failing call ends within its bound (timeout x tries + backoff), asserted on the wall clock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import compose, train
from tests.helpers import free_port, one_error_line
from workbench.core import secrets
from workbench.core.errors import UserError
from workbench.rollout import remote, rewards
from workbench.rollout.reward_server import Faults, RewardServer

PROMPTS = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in [(2, 3), (10, 7), (40, 2)] * 4]
ANSWERS = [str(a + b) for a, b in [(2, 3), (10, 7), (40, 2)] * 4]
TEXTS = ["5", " 17 ", "41", "5.", "17", "42", "five", "", "42", "5", "7", "42"]
FAST = {"retries": 2, "backoff_s": 0.05, "request_timeout_s": 2, "timeout_s": 30}


@contextlib.contextmanager
def serve(reward: str = "arith_exact", **kw):
    faults = {k: kw.pop(k) for k in list(kw) if k in Faults.__dataclass_fields__}
    with RewardServer(reward, faults=Faults(**faults), **kw) as server:
        yield server


def client(url: str, **fields) -> remote.HttpReward:
    return remote.HttpReward.from_spec(OmegaConf.create({"url": url, **FAST, **fields}))


def call(fn, n: int = len(TEXTS)):
    return fn(prompts=PROMPTS[:n], completions=TEXTS[:n], completion_ids=[[1]] * n, answer=ANSWERS[:n])


def failure(fn, n: int = len(TEXTS)) -> tuple[str, float]:
    """The one-line message of a call that must fail, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(remote.RewardServiceError) as err:
        call(fn, n)
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg, time.monotonic() - t0


# -- a healthy server ----------------------------------------------------------------------
def test_scores_equal_the_in_process_function(tmp_path):
    """Batched (3 items a request), 2 requests in flight, in order: the scores are arith_exact's
    own; through rewards.score, the tensor is the in-process one bit for bit."""
    with serve(info=True) as server:
        fn = client(server.url, max_batch=3, concurrency=2, info_path=str(tmp_path / "info.jsonl"))
        fn.check_service()
        assert fn.needs_columns == {"answer"}  # from GET /health: checked on every prompt row
        assert call(fn) == rewards.arith_exact(TEXTS, ANSWERS)
        assert server.requests == 4
        assert fn.last_info[1] == {"reward": "arith_exact", "chars": 4}
        rows = [json.loads(x) for x in (tmp_path / "info.jsonl").read_text().splitlines()]
        assert len(rows) == len(TEXTS) and rows[0]["completion"] == "5" and rows[0]["score"] == 1.0
        assert rows[0]["prompt"] == "What is 2 + 3?" and rows[0]["info"]["reward"] == "arith_exact"

        node = OmegaConf.create({"functions": ["http", "arith_exact"], "url": server.url, **FAST})
        fns = rewards.resolve(node)
        rewards.check_columns(fns, [("rows.jsonl:1", {"prompt": "p", "answer": "1"})])
        got = rewards.score(fns, PROMPTS, TEXTS, [[1]] * len(TEXTS), {"answer": ANSWERS}, step=0, limit_s=30)
        assert torch.equal(got[:, 0], got[:, 1])


def test_a_row_without_the_column_the_server_reads_stops_before_weights():
    with serve() as server:
        fns = rewards.resolve(OmegaConf.create({"functions": ["http"], "url": server.url, **FAST}))
        with pytest.raises(UserError, match=r"rows.jsonl:2: reward function 'http' needs the column\(s\) \['answer'\]"):
            rewards.check_columns(fns, [("rows.jsonl:1", {"prompt": "p", "answer": "1"}),
                                        ("rows.jsonl:2", {"prompt": "q"})])


def test_health_by_an_empty_post_and_a_plain_text_health():
    with serve() as server:
        fn = client(server.url, health_path=None)
        fn.check_service()
        assert server.requests == 1  # the zero-item POST
        assert call(fn, 3) == [1.0, 1.0, 0.0]


def test_the_config_node_composes_and_resolves(tmp_path, monkeypatch):
    cfg = compose(["method=grpo", "reward=http", "reward.url=http://127.0.0.1:9"], tmp_path)
    fns = rewards.resolve(cfg.reward)
    assert [(f.name, f.weight) for f in fns] == [("http", 1.0)]
    s = fns[0].fn.settings
    assert (s.score_path, s.health_path, s.retries, s.max_batch, s.concurrency) == ("/score", "/health", 3, 64, 4)
    assert s.info_path == str(tmp_path / "samples" / "reward_info.jsonl")
    monkeypatch.setenv("SOME_REWARD_CRED", "value-of-the-cred-1")
    cfg = compose(["method=grpo", "reward=http", "reward.url=http://127.0.0.1:9",
                   '+reward.headers_from_env={Authorization: "Bearer $SOME_REWARD_CRED"}'], tmp_path)
    fn = rewards.resolve(cfg.reward)[0].fn
    assert fn._secret == {"Authorization": "Bearer value-of-the-cred-1"}
    assert cfg.reward.headers_from_env.Authorization == "Bearer $SOME_REWARD_CRED"  # config.yaml keeps the template
    with pytest.raises(UserError, match="unknown reward function 'htp'.*'model' and 'http'"):
        rewards.resolve(OmegaConf.create({"functions": ["htp"]}))


@pytest.mark.parametrize("fields, expect", [
    ({"url": None}, r"reward=http needs reward.url"),
    ({"url": "127.0.0.1:8000"}, r"not an http:// or https:// URL"),
    ({"url": "http://user:pw12345678@host"}, r"user or password in the URL is not sent"),
    ({"url": "http://h", "retries": -1}, r"reward.retries=-1: must be >= 0"),
    ({"url": "http://h", "max_batch": "many"}, r"reward.max_batch: not a whole number"),
    ({"url": "http://h", "headers": {"Authorization": "Bearer abc"}}, r"reward.headers.Authorization: a secret"),
    ({"url": "http://h", "headers_from_env": {"Authorization": "Bearer abc"}}, r"name an environment variable"),
    ({"url": "http://h", "headers_from_env": {"X-Key": "$NO_SUCH_VAR_HERE"}}, r"\['NO_SUCH_VAR_HERE'\] are not set"),
])
def test_bad_settings_are_one_line(fields, expect):
    with pytest.raises(UserError, match=expect) as err:
        rewards.resolve(OmegaConf.create({"functions": ["http"], **fields}))
    assert "\n" not in str(err.value) and "pw12345678" not in str(err.value)


# -- faults ---------------------------------------------------------------------------------
def test_a_slow_server_is_named_retried_and_bounded():
    with serve(delay_s=2.0) as server:
        msg, took = failure(client(server.url, request_timeout_s=0.3, retries=2))
    assert msg.startswith(f"reward server {server.url}/score did not answer within 0.3 s (reward.request_timeout_s; "
                          "no HTTP status)"), msg
    assert "3 of 3 tries failed (2 retries, backoff 0.05 s" in msg and "(request of items 0-11)" in msg
    assert server.requests == 3
    assert took < 3 * 0.3 + 0.05 + 0.1 + 1.0  # three timeouts and two backoffs, with scheduling slack


def test_a_slow_answer_within_the_timeout_is_waited_for():
    with serve(delay_s=0.3) as server:
        assert call(client(server.url, request_timeout_s=2), 3) == [1.0, 1.0, 0.0]


def test_5xx_is_retried_with_backoff_then_stops_in_one_line():
    with serve(fail_first=2) as server:  # the third try succeeds, after waits of 0.1 and 0.2 s
        t0 = time.monotonic()
        assert call(client(server.url, retries=3, backoff_s=0.1), 3) == [1.0, 1.0, 0.0]
        assert time.monotonic() - t0 >= 0.3 and server.requests == 3
    with serve(fail_first=100) as server:
        msg, took = failure(client(server.url, retries=3, backoff_s=0.05))
    assert msg == (f"reward server {server.url}/score answered HTTP 500 Internal Server Error: body 'injected failure "
                   "4 of 100 (--fail-first)'; 4 of 4 tries failed (3 retries, backoff 0.05 s doubling up to 30 s) "
                   "(request of items 0-11)")
    assert server.requests == 4 and 0.05 + 0.1 + 0.2 <= took < 2


def test_retry_after_in_seconds_is_read_and_a_date_is_not():
    assert remote._retry_after({"Retry-After": "2"}) == 2.0 and remote._retry_after({"Retry-After": "Wed"}) is None


def test_wrong_number_of_scores_is_not_retried():
    with serve(wrong_count=True) as server:
        msg, _ = failure(client(server.url, max_batch=4))
    assert msg.startswith(f"reward server {server.url}/score answered HTTP 200 with 3 scores for 4 completions (request "
                          "of items ") and "body '{\"scores\": [1.0, 1.0, 0.0]}'" in msg and "not retried" not in msg
    assert server.requests <= 3  # the first failure ends the call: no request is tried again


@pytest.mark.parametrize("bad, what", [("nan", "nan (not finite)"), ("inf", "inf (not finite)"),
                                       ("high", "'high' (not a number)")])
def test_non_numeric_scores_are_named(bad, what):
    with serve(bad_score=bad) as server:
        msg, _ = failure(client(server.url), 3)
    assert msg.startswith(f"reward server {server.url}/score answered HTTP 200 with score {what} for item 0 "
                          "(completion '5')"), msg
    assert server.requests == 1


def test_a_server_that_stops_answering_is_named_and_bounded():
    with serve(die_after=1) as server:
        fn = client(server.url, request_timeout_s=1, retries=2)
        assert call(fn, 3) == [1.0, 1.0, 0.0]
        msg, took = failure(fn, 3)
    assert msg.startswith(f"reward server {server.url}/score "), msg
    assert ("refused the connection (no HTTP status; nothing listens there)" in msg
            or "closed the connection without a whole answer" in msg)
    assert "3 of 3 tries failed" in msg and took < 3 * 1 + 0.15 + 1.0


def test_the_whole_call_is_bounded_by_reward_timeout_s():
    """A request timeout longer than reward.timeout_s does not outlast it: the client gives up
    first (before rewards.score's hard limit), naming the last failure."""
    with serve(delay_s=5) as server:
        msg, took = failure(client(server.url, request_timeout_s=60, retries=5, timeout_s=1.0), 3)
    assert "did not answer within 0.9" in msg and "s (what reward.timeout_s=1 left; no HTTP status)" in msg, msg
    assert "1 of 6 tries failed, and reward.timeout_s=1 leaves no time for another" in msg, msg
    assert took < 1.5


def test_a_4xx_is_not_retried_and_the_step_is_named(monkeypatch):
    with serve(token="the-right-token-1234") as server:
        fns = rewards.resolve(OmegaConf.create({"functions": ["http"], "url": server.url, **FAST}))
        with pytest.raises(UserError) as err:
            rewards.score(fns, PROMPTS[:3], TEXTS[:3], [[1]] * 3, {"answer": ANSWERS[:3]}, step=4, limit_s=30)
    assert str(err.value) == (f"reward function 'http' at step 5: reward server {server.url}/score answered HTTP 401 "
                              "Unauthorized: body '{\"error\": \"missing or wrong Authorization header\"}'; not retried: "
                              "the service is wrong, not busy (request of items 0-2)")
    assert server.requests == 1


def test_down_at_start_fails_before_weights_in_one_line(tmp_path, monkeypatch):
    import workbench.models.build as build

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the reward server was checked")

    monkeypatch.setattr(build, "load_model", no_weights)
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(remote.RewardServiceError) as err:
        train(["method=grpo", "reward=http", f"reward.url=http://127.0.0.1:{port}", "reward.retries=1",
               "reward.backoff_s=0.05", "train.max_steps=1"], tmp_path)
    assert str(err.value) == (f"reward=http: the reward server is not ready: http://127.0.0.1:{port}/health refused "
                              "the connection (no HTTP status; nothing listens there); 2 of 2 "
                              "tries failed (1 retry, backoff 0.05 s doubling up to 30 s); start it (e.g. python -m "
                              "workbench.rollout.reward_server --reward arith_exact --port 8000) or correct reward.url")
    assert time.monotonic() - t0 < 20


# -- secrets ----------------------------------------------------------------------------------
def test_the_token_never_appears_in_messages_logs_or_files(tmp_path, monkeypatch, caplog, capsys):
    token = "rw-9f8e7d6c5b4a39281706"
    monkeypatch.setenv("MY_REWARD_CRED", token)  # a name that does not look secret: registration scrubs it
    spec = {"headers_from_env": {"Authorization": "Bearer $MY_REWARD_CRED"}, "info_path": str(tmp_path / "i.jsonl")}
    caplog.set_level(logging.DEBUG)
    with serve(token=token, info=True) as server:
        fn = client(server.url, **spec)
        assert call(fn, 3) == [1.0, 1.0, 0.0]  # the header reached the server
        assert token not in repr(fn) and token not in repr(fn.settings)
    with serve(echo_headers=True) as server:  # a careless service quotes the request's headers back
        msg, _ = failure(client(server.url, retries=0, **spec), 3)
    assert "answered HTTP 500" in msg and "Authorization" in msg and secrets.REDACTED in msg
    assert secrets.scrub_text(f"sent {token}") == f"sent {secrets.REDACTED}"  # every writer scrubs it from now on
    out = capsys.readouterr()
    for text in (msg, caplog.text, out.out, out.err, (tmp_path / "i.jsonl").read_text()):
        assert token not in text


# -- runs ---------------------------------------------------------------------------------------
GRPO = ["method=grpo", "train.max_steps=3", "train.resume=never", "train.checkpoint_every=1", "method.log_completions=0"]


CURVE = ("loss", "grad_norm", "reward", "reward_std", "entropy")  # what the steps logged, compared


def curve(run) -> list[tuple]:
    return [tuple(r[k] for k in CURVE) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize("reward", ["arith_exact", "tests.rewards:char_length"])
def test_grpo_learns_the_same_from_the_server(tmp_path, reward):
    """Same seed, same steps: the reward from the server is the in-process reward (JSON carries a
    float64 exactly, so the rewards are equal bit for bit), hence the same losses, gradient norms,
    rewards and entropies, exactly (tolerance 0: the same arithmetic in the same process).
    arith_exact on a random model scores 0 everywhere; char_length has spread, so the gradients
    are not 0 and the weights move (an on-policy GRPO loss is 0 up to rounding either way)."""
    # arith_exact scores 0 everywhere, so dynamic sampling would refill every group, generating
    # rounds of rollouts that change nothing here (about twice the test's time); char_length keeps it on
    grpo = [*GRPO, "method.dynamic_sampling=false"] if reward == "arith_exact" else GRPO
    local = train([*grpo, f"reward.functions=[{reward}]"], tmp_path / "local")
    with serve(reward) as server:
        remote_run = train([*grpo, "reward=http", f"reward.url={server.url}", "reward.max_batch=5"], tmp_path / "http")
        assert server.requests >= 3
    assert remote_run["losses"] == local["losses"]
    assert curve(tmp_path / "http") == curve(tmp_path / "local")
    if reward != "arith_exact":
        assert all(step[1] > 0 for step in curve(tmp_path / "local"))  # gradients: the runs trained


def test_a_service_lost_mid_run_stops_it_keeping_its_checkpoints(tmp_path):
    """The server answers 2 rollouts then dies: the run stops at step 3 with one line; step 2,
    the last one trained, is checkpointed as the run stops (train.checkpoint_every=10 wrote none),
    and the run resumes from it once the service is back (at the same URL: reward.url is part of
    the run's config), to the losses of a run that never lost it."""
    overrides = [*GRPO, "method.dynamic_sampling=false", "reward=http", "reward.retries=1", "reward.backoff_s=0.05",
                 "train.checkpoint_every=10"]
    with serve("tests.rewards:char_length") as server:
        whole = train([*overrides, f"reward.url={server.url}"], tmp_path / "whole")
    run, port = tmp_path / "cut", free_port()
    with serve("tests.rewards:char_length", port=port, die_after=2) as server:
        t0 = time.monotonic()
        with pytest.raises(remote.RewardServiceError) as err:
            train([*overrides, f"reward.url={server.url}"], run)
    msg = str(err.value)
    assert msg.startswith(f"reward function 'http' at step 3: reward server {server.url}/score ") and "\n" not in msg
    assert "2 of 2 tries failed (1 retry, backoff 0.05 s" in msg and time.monotonic() - t0 < 30
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert msg.endswith("step-00000002 is kept; relaunch with the same output_dir once the service answers "
                        "(train.resume=auto continues from it)")
    with serve("tests.rewards:char_length", port=port) as server:
        resumed = train([*[o for o in overrides if o != "train.resume=never"], "train.resume=auto",
                         f"reward.url={server.url}"], run)
    assert resumed["resumed_from"] is not None
    assert resumed["losses"] == whole["losses"][2:], (resumed["losses"], whole["losses"])


@pytest.mark.slow
def test_the_command_line_says_one_line(tmp_path):
    port = free_port()
    line, log = one_error_line(["model=tiny", "method=grpo", "reward=http", f"reward.url=http://127.0.0.1:{port}",
                                "reward.retries=0", f"output_dir={tmp_path / 'run'}", "train.max_steps=1"], timeout=300)
    assert line.startswith(f"error: reward=http: the reward server is not ready: http://127.0.0.1:{port}/health "
                           "refused the connection") and "Traceback" not in log


def test_an_excerpt_never_holds_part_of_a_secret():
    secret = "tok-abcdefghijklmnopqrstuvwxyz"
    secrets.register_secret(secret)
    body = (" " * 5000 + f"x {secret} y").encode()  # the whitespace collapses: the secret is near the start
    assert remote._excerpt(body) == f"'x {secrets.REDACTED} y'"
    assert "tok-abc" not in remote._excerpt(body[:5010], partial=True)  # read in part, ending inside the secret
