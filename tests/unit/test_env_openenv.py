"""env=openenv (workbench/envs/openenv.py) against the calculator served by openenv-core's own server
(workbench/envs/openenv_calc.py), in this process on a free port: the same episodes and rewards as
env=calc, and a dead, slow, refusing or dropped server named in one line within a bound.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_env_openenv.py

Every failure is one line naming the session endpoint (ws://127.0.0.1:PORT/ws), the message that
failed and why; every failing call ends within its bound, asserted on the wall clock.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import compose, train
from tests.helpers import ROOT, free_port
from tests.unit.test_episodes import ROW, scripted
from workbench.data.chat import setup_tokenizer
from workbench.envs import openenv as oe
from workbench.envs.calculator import TOOL, evaluate
from workbench.envs.registry import load
from workbench.envs.rewards import final_answer
from workbench.envs.tools import ToolCall
from workbench.models.load import load_tokenizer
from workbench.rollout import episodes
from workbench.rollout.turns import Turns

calc_server = pytest.importorskip("workbench.envs.openenv_calc", reason="openenv-core is not installed "
                                  "(pip install --no-deps openenv-core==0.3.0 && pip install fastmcp)")
CalcServer = calc_server.CalcServer

FAST = ["env.retries=1", "env.backoff_s=0.05", "env.connect_timeout_s=2", "env.timeout_s=2"]


def hydra_value(v) -> str:
    """A JSON-like value in Hydra's override grammar (keys bare, strings quoted)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {hydra_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(hydra_value, v)) + "]"
    return json.dumps(v)


TOOLS = f"env.tools=[{hydra_value(TOOL)}]"  # given: the server is not asked (list_tools) at load


def setup(url: str, extra=()):
    cfg = compose(["method=grpo", "env=openenv", f"env.url={url}", *FAST, *extra])
    tok = load_tokenizer(cfg.model)
    return load(cfg.env), tok, setup_tokenizer(tok)


def failure(fn) -> tuple[str, float]:
    """The one-line message of a call that must fail, and how long it took."""
    t0 = time.monotonic()
    with pytest.raises(oe.EnvServerError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg, time.monotonic() - t0


# -- the served calculator is env=calc -----------------------------------------------------------
def test_served_episodes_and_rewards_equal_env_calc():
    """The same scripted turns through env=calc and the served calculator: the same messages, token
    ids and sampled-token labels, and the server's reward (reward=env) equals reward=final_answer on
    env=calc's conversation, episode by episode (right, wrong, bare, a broken call, a failing tool,
    cut at max_turns)."""
    with CalcServer() as server:
        remote, tok, contract = setup(server.url)
        local = load(compose(["method=grpo", "env=calc"]).env)
        assert remote.tools == local.tools  # listed by the server: the calculator's own schema
        turns = Turns(tok, contract, local.tools)
        call = turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
        bad = turns.format.render(ToolCall("calc", {"expression": "1 / 0"}))
        scripts = [[call, "936"], [call, "1000"], ["936"], ["no"], [call, "bad <tool_call>", "936"], [bad, "x"],
                   [call, call, call]]
        for script in scripts:
            mine = episodes.run(local, turns, [ROW], scripted(tok, script), max_new_tokens=64, max_turns=3)[0]
            theirs = episodes.run(remote, turns, [ROW], scripted(tok, script), max_new_tokens=64, max_turns=3)[0]
            assert theirs.messages == mine.messages, script
            assert (theirs.ids, theirs.labels, theirs.cut) == (mine.ids, mine.labels, mine.cut), script
            want = final_answer([mine.messages], [ROW["answer"]])[0]
            assert (theirs.reward or 0.0) == want, (script, theirs.reward, want)
            assert remote.correct(theirs.state, theirs.messages) == (False if mine.cut else want == 1.0)  # as env=calc
        assert theirs.cut == "max_turns" and theirs.state["session"].ws is None  # closed though cut
        assert [e.reward for e in episodes.run(remote, turns, [ROW], scripted(tok, [call, "936"]),
                                               max_new_tokens=64)] == [1.0]


GRPO = ["method=grpo", "train.max_steps=2", "train.resume=never", "method.log_completions=0", "method.num_generations=4",
        "train.micro_batch_size=8", "method.dynamic_sampling=false"]
CURVE = ("loss", "grad_norm", "reward", "reward_std", "entropy")
QUESTION = re.compile(r"What is (\d+ [-+*/] \d+)\?")


def curve(run) -> list[tuple]:
    return [tuple(r[k] for k in CURVE) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def scripted_policy(monkeypatch):
    """The episodes' turns written by a script instead of sampled (the tiny random model never
    ends a turn, so it would never call the tool): a calc call on the question, then its value,
    or the value + 1 for every other episode (rewards with spread, so the weights move)."""
    from workbench.methods import grpo_env

    def sampler(self, *a, **k):
        tok, fmt, count = self.turns.tok, self.turns.format, [0]

        def sample(prompts, first):
            out = []
            for ids in prompts:
                expression = QUESTION.search(tok.decode(ids)).group(1)
                if first:
                    text = fmt.render(ToolCall("calc", {"expression": expression}))
                else:
                    count[0] += 1
                    text = str(int(evaluate(expression)) + count[0] % 2)
                out.append(tok(text, add_special_tokens=False)["input_ids"])
            return out

        return sample

    monkeypatch.setattr(grpo_env.EpisodeRollouts, "sampler", sampler)


def test_grpo_through_the_server_trains_as_env_calc(tmp_path, monkeypatch):
    """Same seed, same turns: GRPO through the served calculator with the server's reward
    (reward=env, as conf/env/openenv.yaml ships) logs exactly the losses, gradient norms, rewards
    and entropies of env=calc with reward=final_answer: every episode calls the tool, reads the
    server's result and is scored by the server."""
    scripted_policy(monkeypatch)
    local = train(["env=calc", *GRPO], tmp_path / "calc")
    with CalcServer() as server:
        served = train(["env=openenv", f"env.url={server.url}", *FAST, *GRPO], tmp_path / "openenv")
    assert served["losses"] == local["losses"]
    assert curve(tmp_path / "openenv") == curve(tmp_path / "calc")
    rows = [json.loads(x) for x in (tmp_path / "openenv" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["episode/turns"], r["episode/tool_calls"], r["reward"]) for r in rows] == [(2.0, 1.0, 0.5)] * 2
    assert all(step[1] > 0 for step in curve(tmp_path / "calc"))


def test_openenv_own_client_talks_to_the_served_calculator():
    """The served calculator is an OpenEnv server as openenv-core's own client knows it."""
    from openenv.core import GenericEnvClient

    with CalcServer() as server, GenericEnvClient(base_url=server.url).sync() as client:
        client.reset(answer="936")
        got = client.step({"type": "call_tool", "tool_name": "calc", "arguments": {"expression": "347 + 589"}})
        assert got.observation["result"] == "936" and not got.done
        got = client.step({"answer": "936"})
        assert got.done and got.reward == 1.0


# -- failures: one line, bounded ----------------------------------------------------------------
def test_a_dead_server_stops_the_run_before_weights_in_one_line(tmp_path, monkeypatch):
    import workbench.models.build as build

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the environment server was checked")

    monkeypatch.setattr(build, "load_model", no_weights)
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(oe.EnvServerError) as err:
        train(["method=grpo", "env=openenv", f"env.url=http://127.0.0.1:{port}", *FAST, "train.max_steps=1"], tmp_path)
    assert str(err.value) == (f"env=openenv: the environment server at ws://127.0.0.1:{port}/ws refused the "
                              "connection (nothing listens there); 2 of 2 tries failed (1 retry, backoff 0.05 s "
                              "doubling up to 8 s)")
    assert time.monotonic() - t0 < 20


def test_a_slow_server_is_named_and_bounded():
    """Every step sleeps 1.5 s, env.timeout_s=0.3: listing the tools at load, and a tool call in an
    episode, each stop in one line within the bound (2 tries x 0.3 s, plus the backoff)."""
    with CalcServer(delay_s=1.5) as server:
        end = "did not answer step (list_tools) within 0.3 s (env.timeout_s): the environment is slow or stuck"
        msg, took = failure(lambda: setup(server.url, ["env.timeout_s=0.3"]))
        assert msg == (f"env=openenv: the environment server at ws://127.0.0.1:{server.port}/ws {end}; 2 of 2 tries "
                       "failed (1 retry, backoff 0.05 s doubling up to 8 s)")
        assert took < 3, took
        env, tok, contract = setup(server.url, ["env.timeout_s=0.3", TOOLS])  # reset is not slow; steps are
        turns = Turns(tok, contract, env.tools)
        call = turns.format.render(ToolCall("calc", {"expression": "2 + 2"}))
        msg, took = failure(lambda: episodes.run(env, turns, [ROW], scripted(tok, [call, "4"]), max_new_tokens=64))
        assert "did not answer step (call_tool calc) within 0.3 s (env.timeout_s)" in msg and "2 of 2 tries" in msg
        assert took < 3, took


def test_a_server_that_never_accepts_the_session_is_bounded():
    """A socket that listens but never answers the WebSocket upgrade: connect_timeout_s bounds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        port = sock.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(oe.EnvServerError) as err:
            load(compose(["method=grpo", "env=openenv", f"env.url=http://127.0.0.1:{port}", "env.retries=1",
                          "env.backoff_s=0.05", "env.connect_timeout_s=0.3"]).env)
    assert str(err.value).startswith(f"env=openenv: the environment server at ws://127.0.0.1:{port}/ws did not "
                                     "accept a session within 0.3 s (env.connect_timeout_s)")
    assert time.monotonic() - t0 < 3


def test_a_dropped_session_is_replayed_and_the_episode_goes_on():
    """The connection drops mid-episode: the retry opens a fresh session, resets it with the row's
    data and replays the call, then sends the answer; the reward is the one of an unbroken episode."""
    with CalcServer() as server:
        env, tok, contract = setup(server.url, [TOOLS])
        turns = Turns(tok, contract, env.tools)
        call = turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
        script = iter([call, "936"])
        state = {}

        def sample(prompts, first):
            if not first:  # after the call was answered: the server loses the session
                state["session"] = ep_state()
                state["session"].ws.close()
            return [tok(next(script), add_special_tokens=False)["input_ids"] for _ in prompts]

        original = env.reset
        ep_state = None

        def reset(row):
            nonlocal ep_state
            st = original(row)
            ep_state = lambda: st["session"]  # noqa: E731
            return st

        env.reset = reset
        ep = episodes.run(env, turns, [ROW], sample, max_new_tokens=64)[0]
        assert ep.reward == 1.0 and [m["content"] for m in ep.messages[ep.opening:]][1:] == ["936", "936"]
        assert len(state["session"].actions) == 2  # the call (replayed), then the answer


def test_a_server_at_capacity_is_named_not_retried():
    with CalcServer(max_sessions=1) as server:
        env, tok, contract = setup(server.url, [TOOLS])
        turns = Turns(tok, contract, env.tools)
        msg, took = failure(lambda: episodes.run(env, turns, [ROW], scripted(tok, ["x", "y"]), repeat=2))
    assert "refused a session at reset: it allows 1 at once (max_concurrent_envs)" in msg
    assert msg.endswith("not retried: the environment is wrong, not busy") and took < 3


def test_an_error_answer_is_not_retried():
    """A call the server's action model refuses comes back as an OpenEnv error message: named, not retried."""
    with CalcServer() as server:
        env, tok, contract = setup(server.url, [TOOLS, "env.answer_field=final"])  # CalcAction has no 'final'
        turns = Turns(tok, contract, env.tools)
        msg, _ = failure(lambda: episodes.run(env, turns, [ROW], scripted(tok, ["936"]), max_new_tokens=64))
    assert msg.startswith(f"env=openenv: the environment server at ws://127.0.0.1:{server.port}/ws answered step "
                          "(the final answer) with an error: ")
    assert "(code VALIDATION_ERROR" in msg or "(code EXECUTION_ERROR" in msg, msg


@pytest.mark.parametrize(("extra", "expect"), [
    ([], "env=openenv needs exactly one of env.url"),
    (["env.url=ftp://x"], "env.url=ftp://x: not an http://, https://, ws:// or wss:// URL with a host"),
    (["env.url=http://127.0.0.1:1", "env.timeout_s=0"], "env.timeout_s=0.0: must be > 0 (seconds)"),
    (["env.url=http://127.0.0.1:1", "env.reset_fields=answer"], "env.reset_fields: expected a list of row columns"),
    (["env.serve=nocolon"], "env.serve='nocolon': name the server's ASGI app as 'package.module:app'"),
])
def test_bad_settings_are_one_line(extra, expect):
    from workbench.core.errors import UserError

    with pytest.raises(UserError) as err:
        load(compose(["method=grpo", "env=openenv", *extra]).env)
    assert str(err.value).startswith(expect), str(err.value)


# -- a server started from a package; what env=calc imports -----------------------------------
def test_env_serve_starts_the_server_on_loopback():
    env = load(compose(["method=grpo", "env=openenv", "env.serve=workbench.envs.openenv_calc:app", *FAST]).env)
    url = oe._STARTED["workbench.envs.openenv_calc:app"]
    assert url.startswith("http://127.0.0.1:") and env.settings.url == url.replace("http://", "ws://")
    state = env.reset(ROW)
    env.end(state)
    again = load(compose(["method=grpo", "env=openenv", "env.serve=workbench.envs.openenv_calc:app", *FAST]).env)
    assert again.settings.url == env.settings.url  # one server per process (preflight and the run share it)


def test_env_calc_and_import_workbench_import_no_openenv():
    code = ("import sys, workbench, workbench.cli\nfrom workbench.envs.registry import load\n"
            "from omegaconf import OmegaConf\n"
            "load(OmegaConf.create({'name': 'calc', 'max_turns': 3, 'max_new_tokens': 8}))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('openenv', 'websockets', 'fastmcp', 'mcp')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_the_command_line_says_one_line_and_exits_2(tmp_path):
    """python -m workbench against a dead server: one `error:` line naming the URL, exit 2 (a
    UserError), no traceback, before any weights load."""
    port = free_port()
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WORKBENCH_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "workbench", "model=tiny", "method=grpo", "env=openenv",
                           f"env.url=http://127.0.0.1:{port}", "env.retries=0", f"output_dir={tmp_path / 'run'}",
                           "train.max_steps=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 2, log[-3000:]
    assert [x for x in log.splitlines() if x.startswith("error:")] == [
        f"error: env=openenv: the environment server at ws://127.0.0.1:{port}/ws refused the connection "
        "(nothing listens there); 1 of 1 tries failed (env.retries=0)"], log[-3000:]
    assert "Traceback" not in log and time.monotonic() - t0 < 60
