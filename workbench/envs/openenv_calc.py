"""The calculator task (workbench/envs/calculator.py) served as an OpenEnv environment, with
openenv-core's own server (`create_fastapi_app`): what env=openenv trains against in the tests
and the docs, and an example of wrapping an environment for OpenEnv.

    python -m workbench.envs.openenv_calc --port 8011          # on 127.0.0.1
    python -m workbench method=grpo env=openenv env.url=http://127.0.0.1:8011
    python -m workbench method=grpo env=openenv env.serve=workbench.envs.openenv_calc:app   # started by the run

Needs openenv-core 0.3.0 (`pip install --no-deps openenv-core==0.3.0 && pip install fastmcp`: its
gradio, openai and tomli-w serve its web UI and CLI, which this does not use). The protocol is
openenv-core's: a WebSocket session per episode at /ws, `reset(answer=...)` with the row's answer,
then actions in OpenEnv's MCP shapes:

    {"type": "list_tools"}                                          -> {"tools": [{"name": "calc", ...}]}
    {"type": "call_tool", "tool_name": "calc", "arguments": {"expression": "347 + 589"}}
                                                                    -> {"result": "936"} or {"error": {...}}
    {"answer": "936"}   (the model's turn without a call)          -> done, reward 1.0 if it is the answer, else 0.0

The tool is the calculator's `evaluate`, so a served episode gives the model the same tool
results, and its final answer the same reward, as env=calc with reward=final_answer.
`--delay S` makes every step sleep S seconds first (a slow server, for the tests).

In a test, on a free port, in a thread of the test's process:

    with CalcServer(delay_s=0.0) as server:
        ... env.url=server.url ...
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import threading
import time
from typing import Any, Literal

import uvicorn

try:
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app
except ImportError as exc:  # one line in env.serve's error, which quotes the server's last line
    raise ImportError("the OpenEnv calculator needs openenv-core 0.3.0: pip install --no-deps openenv-core==0.3.0 "
                      f"&& pip install fastmcp ({exc})") from exc

from workbench.envs.calculator import TOOL, CalcError, evaluate

MAX_SESSIONS = 512  # a rollout keeps one session per running episode (prompts x num_generations)


class CalcAction(Action):
    """A tool call or list in OpenEnv's MCP shapes, or the final answer (`type` omitted)."""
    type: Literal["answer", "call_tool", "list_tools"] = "answer"
    tool_name: str | None = None
    arguments: dict[str, Any] = {}
    answer: str | None = None


class CalcObservation(Observation):
    message: str = ""  # what a person reading the episode is told
    tools: list[dict] | None = None  # list_tools: {name, description, input_schema}
    tool_name: str | None = None
    result: str | None = None  # call_tool: the calculator's answer
    error: dict | None = None  # call_tool: {"error_type", "message"}, as MCP's ToolError


class CalcEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance; nothing is shared

    def __init__(self, delay_s: float = 0.0):
        super().__init__()
        self.delay_s = delay_s
        self._state = State(step_count=0)
        self.answer = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: Any = None,
              **kwargs: Any) -> CalcObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.answer = "" if answer is None else str(answer).strip()
        return CalcObservation(message="Use calc(expression) for the arithmetic, then answer with the number.")

    def step(self, action: CalcAction, timeout_s: float | None = None, **kwargs: Any) -> CalcObservation:
        if self.delay_s:
            time.sleep(self.delay_s)
        self._state.step_count += 1
        if action.type == "list_tools":
            fn = TOOL["function"]
            return CalcObservation(tools=[{"name": fn["name"], "description": fn["description"],
                                           "input_schema": fn["parameters"]}])
        if action.type == "call_tool":
            if action.tool_name != "calc":
                return CalcObservation(tool_name=action.tool_name, error={
                    "error_type": "tool_not_found", "message": f"unknown tool {action.tool_name!r}; the tool is calc"})
            try:
                return CalcObservation(tool_name="calc", result=evaluate(action.arguments.get("expression")))
            except CalcError as exc:
                return CalcObservation(tool_name="calc", error={"error_type": "execution_error", "message": str(exc)})
        given = (action.answer or "").strip()
        right = given == self.answer
        return CalcObservation(done=True, reward=1.0 if right else 0.0,
                               message="correct" if right else f"wrong: the answer is {self.answer}")

    @property
    def state(self) -> State:
        return self._state


def make_app(delay_s: float = 0.0, max_sessions: int = MAX_SESSIONS):
    factory = functools.partial(CalcEnvironment, delay_s=delay_s) if delay_s else CalcEnvironment
    return create_fastapi_app(factory, CalcAction, CalcObservation, max_concurrent_envs=max_sessions)


# `uvicorn workbench.envs.openenv_calc:app` and env.serve=workbench.envs.openenv_calc:app serve this;
# WORKBENCH_OPENENV_CALC_DELAY_S gives it the --delay of the command line
app = make_app(float(os.environ.get("WORKBENCH_OPENENV_CALC_DELAY_S", "0") or 0))


class CalcServer:
    """The served calculator on 127.0.0.1 in a thread of this process: `with CalcServer() as s: s.url`."""

    def __init__(self, port: int = 0, delay_s: float = 0.0, max_sessions: int = MAX_SESSIONS):
        if not port:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        config = uvicorn.Config(make_app(delay_s, max_sessions), host="127.0.0.1", port=port, log_level="warning",
                                ws="websockets-sansio", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> CalcServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv calculator did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workbench.envs.openenv_calc", description=__doc__.split("\n")[0])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--delay", type=float, default=0.0, help="seconds every step sleeps first (a slow server)")
    p.add_argument("--max-sessions", type=int, default=MAX_SESSIONS)
    a = p.parse_args(argv)
    print(f"OpenEnv calculator on http://127.0.0.1:{a.port} (sessions at ws://127.0.0.1:{a.port}/ws)", flush=True)
    uvicorn.run(make_app(a.delay, a.max_sessions), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
