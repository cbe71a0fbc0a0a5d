"""env=openenv: multi-turn GRPO against an OpenEnv environment server (PyPI `openenv-core`).

    python -m workbench.envs.openenv_calc --port 8011 &        # the calculator, served as an OpenEnv environment
    python -m workbench method=grpo env=openenv env.url=http://127.0.0.1:8011 model.path=<warm start>
    python -m workbench method=grpo env=openenv env.serve=workbench.envs.openenv_calc:app   # started here, on loopback

An environment someone else wrote as an OpenEnv server (`create_app`/`create_fastapi_app` of
openenv-core around its `Environment` class) plugs into the episode loop through the same
`workbench.envs.base.Environment` interface as env=calc. Each episode holds one session: the
OpenEnv WebSocket protocol at `<url>/ws` (the one its own `EnvClient` speaks; the plain HTTP
`/reset` and `/step` build a fresh environment per request, so they cannot carry an episode):

    -> {"type": "reset", "data": {<env.reset_fields of the row>}}        at the episode's start
    -> {"type": "step", "data": {"type": "call_tool", "tool_name": n, "arguments": {...}}}   per tool call
    -> {"type": "step", "data": {<env.answer_field>: <the turn's text>}}  a turn without a call (if set)
    -> {"type": "close"}                                                  when the episode ends or is cut
    <- {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
    <- {"type": "error", "data": {"message": ..., "code": ...}}

Tool calls use OpenEnv's MCP action shapes (RFC 003: `call_tool`, `list_tools`); with `env.tools:
null` the tools are asked of the server once (`{"type": "list_tools"}`: `{"tools": [{"name",
"description", "input_schema"}]}`). A call's observation becomes the tool message: its `result`
(text, or MCP content items) or, when it has an `error`, `error: <message>`. An observation with
`done: true` ends the episode with its `reward` (reward=env reads it); a turn without a call is
sent as `{answer_field: text}` and, when the server does not end the episode, the observation's
`env.observation_field` goes back to the model as a user message. With `answer_field: null` such a
turn ends the episode without asking the server (the run's reward functions score it).
`env.prompt_field` puts the reset observation's text in the episode's user message, for servers
that pose the task themselves.

Failure (the guarantees of reward=http): every connection waits at most `connect_timeout_s`, every
answer at most `timeout_s`. A refused or dropped connection or a timeout is tried again, `retries`
times after `backoff_s` (doubling up to `backoff_max_s`), on a fresh session that is reset with
the same data and replays the episode's actions so far (an environment server is assumed
deterministic given its reset data). An error answer or one that is not an observation is not
retried: the environment is wrong, not busy. Then the run stops with one line naming the URL,
the message that failed and why, before any weights load when the server is down at the start
(preflight loads the environment, which opens a session). One call never outlasts
(1 + retries) x (connect_timeout_s + timeout_s) plus its backoff, replays included.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from omegaconf import DictConfig, ListConfig, OmegaConf

from workbench.core.errors import UserError
from workbench.envs import tools as tool_fmt
from workbench.envs.base import Environment, Reply, ToolResult, Turn

EXCERPT = 200  # characters of an unexpected answer quoted in an error
MAX_MESSAGE = 16 * 2**20  # an observation larger than this is not one the model could read


class EnvServerError(UserError):
    """The environment server failed or broke the protocol; one line, naming the URL. A run that
    loses the server mid-run keeps its checkpoints (workbench/run/loop.py), as for a reward service."""


def public_url(url: str) -> str:
    """`url` as errors show it: no user part, no query (as workbench/rollout/remote.py shows a reward
    server's; not imported from there: rollout already imports envs)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


@dataclass(frozen=True)
class Settings:
    url: str  # ws://host:port (no trailing slash); the session endpoint is url + "/ws"
    connect_timeout_s: float = 5.0
    timeout_s: float = 30.0
    retries: int = 2
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    reset_fields: tuple = ("answer",)
    answer_field: str | None = None
    observation_field: str | None = "message"
    prompt_field: str | None = None
    success_reward: float = 1.0

    @property
    def endpoint(self) -> str:
        return public_url(self.url + "/ws")

    def schedule(self) -> str:
        if not self.retries:
            return "env.retries=0"
        return (f"{self.retries} {'retry' if self.retries == 1 else 'retries'}, backoff {self.backoff_s:g} s "
                f"doubling up to {self.backoff_max_s:g} s")

    def bound(self) -> float:
        """The longest one call may take: every try's connection and answer, and the backoff between."""
        waits = sum(min(self.backoff_s * 2**i, self.backoff_max_s) for i in range(self.retries))
        return (self.retries + 1) * (self.connect_timeout_s + self.timeout_s) + waits


def _number(cfg: dict, key: str, default, kind, check, need: str):
    value = cfg.get(key, default)
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise UserError(f"env.{key}: not a {'whole ' if kind is int else ''}number: {value!r}") from None
    if not check(value):
        raise UserError(f"env.{key}={value}: must be {need}")
    return value


def _name(cfg: dict, key: str, default):
    value = cfg.get(key, default)
    if value is not None and (not isinstance(value, str) or not value):
        raise UserError(f"env.{key}: expected a field name or null, got {value!r}")
    return value


def ws_url(value) -> str:
    """env.url as a ws:// or wss:// base URL without a trailing slash (http:// and https:// are
    accepted, as openenv's EnvClient accepts them); UserError for anything else."""
    url = str(value).rstrip("/")
    parts = urllib.parse.urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise UserError(f"env.url={public_url(url)}: not an http://, https://, ws:// or wss:// URL with a host")
    if parts.username or parts.password or parts.query:
        raise UserError(f"env.url={public_url(url)}: a user, password or query in the URL is not supported "
                        "(it would be written to config.yaml)")
    if parts.path.endswith("/ws"):  # the base URL is asked for; accept the session endpoint too
        parts = parts._replace(path=parts.path[:-3])
    return urllib.parse.urlunsplit(parts._replace(scheme=scheme)).rstrip("/")


def settings(cfg: dict, url: str) -> Settings:
    fields = cfg.get("reset_fields", ["answer"])
    if fields is None:
        fields = []
    if isinstance(fields, str) or not all(isinstance(f, str) and f for f in fields):
        raise UserError(f"env.reset_fields: expected a list of row columns, got {fields!r}")
    return Settings(
        url=url,
        connect_timeout_s=_number(cfg, "connect_timeout_s", 5.0, float, lambda v: v > 0, "> 0 (seconds)"),
        timeout_s=_number(cfg, "timeout_s", 30.0, float, lambda v: v > 0, "> 0 (seconds)"),
        retries=_number(cfg, "retries", 2, int, lambda v: v >= 0, ">= 0"),
        backoff_s=_number(cfg, "backoff_s", 0.5, float, lambda v: v >= 0, ">= 0 (seconds)"),
        backoff_max_s=_number(cfg, "backoff_max_s", 8.0, float, lambda v: v >= 0, ">= 0 (seconds)"),
        reset_fields=tuple(fields),
        answer_field=_name(cfg, "answer_field", None),
        observation_field=_name(cfg, "observation_field", "message"),
        prompt_field=_name(cfg, "prompt_field", None),
        success_reward=_number(cfg, "success_reward", 1.0, float, lambda v: True, "a number"))


class _Failure(Exception):
    """One try failed: `line` says how, `retry` whether another try may help."""

    def __init__(self, line: str, retry: bool):
        super().__init__(line)
        self.line, self.retry = line, retry


def _excerpt(text) -> str:
    text = " ".join(str(text).split())
    return repr(text[:EXCERPT] + ("..." if len(text) > EXCERPT else ""))


@dataclass
class Session:
    """One episode's session on the server: the reset data and the actions sent since, which a
    retry replays on a fresh connection."""
    reset_data: dict
    actions: list = field(default_factory=list)
    ws: object = None


class Client:
    """The OpenEnv session protocol over a blocking WebSocket, with the timeouts and retries above."""

    def __init__(self, s: Settings):
        try:
            from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
            from websockets.sync.client import connect
        except ImportError:
            raise UserError("env=openenv needs the package 'websockets' (openenv-core's client library); install it "
                            "with: pip install websockets") from None
        self.s = s
        self._connect = connect
        self._closed = (ConnectionClosed,)
        self._handshake = (InvalidHandshake, InvalidURI)

    # -- one try -----------------------------------------------------------------------------
    def _open(self, deadline: float):
        wait = max(0.01, min(self.s.connect_timeout_s, deadline - time.monotonic()))
        try:
            # proxy=None: a loopback server must not be reached through HTTP(S)_PROXY
            # close_timeout: a session given up on is dropped, not waited for
            return self._connect(self.s.url + "/ws", open_timeout=wait, close_timeout=0.2, proxy=None,
                                 max_size=MAX_MESSAGE, ping_interval=None, compression=None)
        except ConnectionRefusedError:
            raise _Failure("refused the connection (nothing listens there)", retry=True) from None
        except TimeoutError:
            raise _Failure(f"did not accept a session within {wait:.3g} s (env.connect_timeout_s): the server is "
                           "slow or stuck", retry=True) from None
        except socket.gaierror as exc:
            raise _Failure(f"has a host name that does not resolve ({exc})", retry=True) from None
        except self._handshake as exc:
            raise _Failure(f"refused the WebSocket session ({type(exc).__name__}: {_excerpt(exc)}); is it an OpenEnv "
                           "server (create_app/create_fastapi_app serves /ws)?", retry=False) from None
        except OSError as exc:
            raise _Failure(f"could not be reached ({type(exc).__name__}: {exc})", retry=True) from None

    def _ask(self, ws, message: dict, what: str, deadline: float) -> dict:
        wait = max(0.01, min(self.s.timeout_s, deadline - time.monotonic()))
        try:
            try:
                ws.send(json.dumps(message))
            except self._closed:
                pass  # a server that refused the session said why before closing: that answer is still to read
            raw = ws.recv(timeout=wait)
        except TimeoutError:
            raise _Failure(f"did not answer {what} within {wait:.3g} s (env.timeout_s): the environment is slow or "
                           "stuck", retry=True) from None
        except self._closed + (OSError,):
            raise _Failure(f"closed the connection during {what} (the server stopped or dropped the session)",
                           retry=True) from None
        try:
            answer = json.loads(raw)
        except (TypeError, ValueError):
            raise _Failure(f"answered {what} with something that is not JSON: {_excerpt(raw)}", retry=False) from None
        kind = answer.get("type") if isinstance(answer, dict) else None
        data = answer.get("data") if isinstance(answer, dict) else None
        if kind == "error" and isinstance(data, dict):
            code, text = data.get("code", "UNKNOWN"), data.get("message", "")
            if code == "CAPACITY_REACHED":
                raise _Failure(f"refused a session at {what}: it allows {data.get('max_sessions', '?')} at once "
                               f"(max_concurrent_envs) and this rollout keeps one open per running episode (prompts "
                               "x method.num_generations); serve it with more, or fewer episodes per step",
                               retry=False)
            raise _Failure(f"answered {what} with an error: {_excerpt(text)} (code {code})", retry=False)
        if kind != "observation" or not isinstance(data, dict) or not isinstance(data.get("observation", {}), dict):
            raise _Failure(f"answered {what} with something that is not an OpenEnv observation: {_excerpt(raw)}",
                           retry=False)
        return data

    # -- calls with retries ----------------------------------------------------------------
    def _with_retries(self, session: Session, message: dict | None, what: str) -> dict:
        """Send `message` in `session` (None: open it with a reset) and its answer; a failed try
        opens a fresh session, resets it and replays the actions so far before trying again."""
        s = self.s
        deadline = time.monotonic() + s.bound()
        for attempt in range(s.retries + 1):
            try:
                if session.ws is None:
                    session.ws = self._open(deadline)
                    answer = self._ask(session.ws, {"type": "reset", "data": session.reset_data}, "reset", deadline)
                    for i, action in enumerate(session.actions):
                        self._ask(session.ws, {"type": "step", "data": action}, f"step {i + 1} (replayed)", deadline)
                    if message is None:
                        return answer
                return self._ask(session.ws, message, what, deadline)
            except _Failure as failure:
                self.close(session, polite=False)
                tries = f"{attempt + 1} of {s.retries + 1} tries"
                head = f"env=openenv: the environment server at {s.endpoint} {failure.line}"
                if not failure.retry:
                    raise EnvServerError(f"{head}; not retried: the environment is wrong, not busy") from None
                if attempt == s.retries:
                    raise EnvServerError(f"{head}; {tries} failed ({s.schedule()})") from None
                pause = min(s.backoff_s * 2**attempt, s.backoff_max_s)
                if time.monotonic() + pause >= deadline:
                    raise EnvServerError(f"{head}; {tries} failed, and the call's bound of {s.bound():.3g} s "
                                         "leaves no time for another") from None
                time.sleep(pause)
        raise AssertionError("unreachable")

    def open(self, reset_data: dict) -> tuple[Session, dict]:
        session = Session(reset_data)
        return session, self._with_retries(session, None, "reset")

    def step(self, session: Session, action: dict, what: str) -> dict:
        answer = self._with_retries(session, {"type": "step", "data": action}, what)
        session.actions.append(action)
        return answer

    def close(self, session: Session, polite: bool = True) -> None:
        """End the session: `polite`, with the protocol's "close" (after a failure, just the socket)."""
        ws, session.ws = session.ws, None
        if ws is None:
            return
        if polite:
            try:
                ws.send(json.dumps({"type": "close"}))
                # the server closes the socket itself after "close": waiting for that (briefly) spares it
                # a close handshake racing ours, which openenv-core's server logs as a traceback
                ws.recv(timeout=min(0.5, self.s.timeout_s))
            except Exception:  # noqa: BLE001 - best effort: the server ends the session when the socket closes
                pass
        try:
            ws.close()
        except Exception:  # noqa: BLE001
            pass


# -- the observation as the model reads it ---------------------------------------------------
def result_text(obs: dict) -> tuple[str, bool]:
    """A tool call's observation as (the tool message's text, whether it is an error): MCP's
    `error` ({"message": ...} or text), else its `result`: text as it is, MCP content items
    joined, or JSON."""
    error = obs.get("error")
    if error:
        message = error.get("message", error) if isinstance(error, dict) else error
        return f"error: {message}", True
    result = obs.get("result")
    if isinstance(result, dict):
        if isinstance(result.get("content"), list):
            texts = [c.get("text", "") for c in result["content"] if isinstance(c, dict)]
            return "\n".join(texts), bool(result.get("is_error") or result.get("isError"))
        if "data" in result:
            result = result["data"]
    if isinstance(result, str):
        return result, False
    return json.dumps(result, default=str), False


def observation_text(obs: dict, key: str | None) -> str:
    if key is None:
        return json.dumps(obs, default=str)
    value = obs.get(key)
    if value is None:
        raise KeyError(key)
    return value if isinstance(value, str) else json.dumps(value, default=str)


def tools_from_server(listed, where: str) -> list[dict]:
    """The observation of `list_tools` as the Hugging Face tool schemas the chat template renders."""
    if not isinstance(listed, list) or not listed:
        raise UserError(f"{where}: the server listed no tools (set env.tools to their JSON schemas instead)")
    out = []
    for t in listed:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise UserError(f"{where}: a listed tool is not {{name, description, input_schema}}: {_excerpt(t)}")
        out.append({"type": "function", "function": {
            "name": t["name"], "description": t.get("description") or "",
            "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object", "properties": {}}}})
    return out


# -- a server started from a package ---------------------------------------------------------
_STARTED: dict[str, str] = {}  # env.serve -> the URL of the server this process started for it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    try:  # Linux: the server gets SIGTERM when the run's process ends, however it ends
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - elsewhere atexit stops it
        pass


def serve(app: str, start_timeout_s: float) -> str:
    """Start `package.module:app` (an OpenEnv server's ASGI app) with uvicorn on 127.0.0.1 at a
    free port, once per process; its URL when /health answers. UserError if it does not."""
    if app in _STARTED:
        return _STARTED[app]
    if ":" not in app:
        raise UserError(f"env.serve={app!r}: name the server's ASGI app as 'package.module:app'")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    # its output goes to a file, not a pipe nobody reads (a full pipe would stall the server)
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), *sys.path]))},
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    atexit.register(_stop, proc)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()
            raise UserError(f"env.serve={app}: the server exited with status {proc.returncode} before it answered: "
                            f"{_excerpt(tail[-1] if tail else '(no output)')}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                if resp.status == 200:
                    _STARTED[app] = url
                    return url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    _stop(proc)
    raise UserError(f"env.serve={app}: the server did not answer {url}/health within {start_timeout_s:g} s "
                    "(env.start_timeout_s)")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- the environment -------------------------------------------------------------------------
class OpenEnv(Environment):
    """A workbench Environment whose episodes are sessions on an OpenEnv server."""

    def __init__(self, cfg):
        url, app = cfg.get("url"), cfg.get("serve")
        if (url is None) == (app is None):
            raise UserError("env=openenv needs exactly one of env.url (a running OpenEnv server, e.g. "
                            "env.url=http://127.0.0.1:8000) and env.serve (its ASGI app to start here, e.g. "
                            "env.serve=workbench.envs.openenv_calc:app)")
        if app is not None:
            url = serve(str(app), _number(cfg, "start_timeout_s", 60.0, float, lambda v: v > 0, "> 0 (seconds)"))
        self.settings = settings(cfg, ws_url(url))
        self.client = Client(self.settings)
        schemas = cfg.get("tools")
        if schemas is None:
            schemas = self._listed_tools()
        elif isinstance(schemas, (DictConfig, ListConfig)):
            schemas = OmegaConf.to_container(schemas, resolve=True)
        self.TOOLS = tool_fmt.check_schemas(schemas, "env.tools" if cfg.get("tools") is not None
                                            else f"the tools {self.settings.endpoint} listed")
        super().__init__(cfg)

    def _listed_tools(self) -> list[dict]:
        session, _ = self.client.open({})
        try:
            answer = self.client.step(session, {"type": "list_tools"}, "step (list_tools)")
        finally:
            self.client.close(session)
        return tools_from_server(answer.get("observation", {}).get("tools"), f"env=openenv: {self.settings.endpoint}")

    def reset(self, row: dict):
        data = {k: row[k] for k in self.settings.reset_fields if k in row}
        session, answer = self.client.open(data)
        return {"session": session, "reset": answer.get("observation", {}), "reward": None, "done": False}

    def prompt(self, state, prompt: list[dict]) -> list[dict]:
        key = self.settings.prompt_field
        if key is None:
            return prompt
        try:
            text = observation_text(state["reset"], key)
        except KeyError:
            raise EnvServerError(f"env=openenv: the reset observation of {self.settings.endpoint} has no field "
                                 f"{key!r} (env.prompt_field); it has {sorted(state['reset'])}") from None
        users = [i for i, m in enumerate(prompt) if m.get("role") == "user"]
        head = prompt[:users[-1]] if users else list(prompt)
        return [*head, {"role": "user", "content": text}]

    def step(self, state, turn: Turn) -> Reply:
        s, session = self.settings, state["session"]
        if not turn.calls and not turn.errors:
            if s.answer_field is None:
                state["done"] = True  # ended by env.answer_field=null, not cut: the server gave no verdict
                return Reply(done=True)
            answer = self.client.step(session, {s.answer_field: turn.text}, "step (the final answer)")
            if self._ended(state, answer):
                return Reply(done=True, reward=state["reward"])
            try:
                text = observation_text(answer.get("observation", {}), s.observation_field)
            except KeyError:
                raise EnvServerError(f"env=openenv: {s.endpoint} answered a turn without ending the episode, and its "
                                     f"observation has no field {s.observation_field!r} (env.observation_field) "
                                     "for the model to read") from None
            return Reply(messages=[{"role": "user", "content": text}])
        results = [ToolResult("error", f"error: could not read the tool call: {e}", True) for e in turn.errors]
        for c in turn.calls:
            problem = tool_fmt.arguments_problem(c, self.tools)
            if problem:  # the server is not asked a call its schema refuses; the model reads why
                results.append(ToolResult(c.name, f"error: {problem}", True))
                continue
            answer = self.client.step(session, {"type": "call_tool", "tool_name": c.name, "arguments": c.arguments},
                                      f"step (call_tool {c.name})")
            text, error = result_text(answer.get("observation", {}))
            results.append(ToolResult(c.name, text, error))
            if self._ended(state, answer):
                return Reply(done=True, reward=state["reward"])
        return Reply(results=results)

    def _ended(self, state, answer: dict) -> bool:
        if not answer.get("done"):
            return False
        reward = answer.get("reward")
        state["done"], state["reward"] = True, None if reward is None else float(reward)
        return True

    def end(self, state) -> None:
        self.client.close(state["session"])

    def correct(self, state, conversation: list[dict]) -> bool | None:
        """Solved: the server ended the episode with a reward of at least env.success_reward. An
        episode the run cut (max_turns, max_new_tokens) before the server ended it is not solved,
        as env=calc counts it; one that ended without a reward says nothing (None)."""
        if not state["done"]:
            return False
        if state["reward"] is None:
            return None
        return state["reward"] >= self.settings.success_reward
