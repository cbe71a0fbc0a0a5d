"""The environment interface of multi-turn GRPO, and loading one by name (`env=<name>`).

    python -m workbench method=grpo env=calc                    # the shipped calculator (conf/env/calc.yaml)
    python -m workbench method=grpo env=calc env.max_turns=2
    python -m workbench method=grpo env.name=mypkg.envs:Shop env.max_turns=6 data.recipe=shop

An environment starts an episode from a data row and answers each model turn:

    class Shop(ToolEnv):
        TOOLS = [{"type": "function", "function": {"name": "price", "description": "...",
                  "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                                 "required": ["item"]}}}]
        def call(self, state, name, arguments) -> str: ...      # a tool's result, as text
        def finish(self, state, turn) -> float | None: ...       # the turn without a call ended it

- `reset(row)` returns the episode's state; the episode starts from the row's `prompt` messages
  (`prompt(state, messages)` may replace them), and `end(state)` is called once it is over;
- `step(state, turn)` gets the model's turn (`Turn`: its text, the tool calls parsed from it by
  the chat template's format, parse errors, the whole conversation so far) and returns a
  `Reply`: tool results and/or user messages to continue with, or `done=True` with the
  environment's own reward (or None: then only the run's reward functions score the episode);
- `correct(state, conversation)` (optional): whether the episode solved its task, for
  `eval.tasks=[env]`'s accuracy;
- `demonstrate(row, fmt)` (optional): a good episode's assistant turns, which `data.preview=true`
  runs through the episode loop in place of the model to show what is trained.
`ToolEnv` implements `step` for tool use: every call in a turn runs (`call`), an unknown tool,
arguments that do not fit its schema, a call that does not parse, or a tool that raises are
answered with an `error: ...` result the model reads; a turn without a call ends the episode.
The env config node (`env.*`: name, max_turns, max_new_tokens, recipe, eval_path and any keys
of your own) is the constructor's one argument. `max_turns` bounds the model's turns; an episode
still calling tools then ends there, cut.

Tools are JSON schemas in the Hugging Face `tools=` convention, checked when the environment
loads (workbench/envs/tools.py), so a bad schema stops the run before any weights load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.core.errors import UserError
from workbench.envs import tools as tool_fmt

# the keys every env node has (conf/env/*.yaml); the rest go to the environment as they are
COMMON = {"name": str, "max_turns": int, "max_new_tokens": int, "recipe": (str, type(None)),
          "eval_path": (str, type(None)), "tool_format": (str, type(None))}


@dataclass
class Turn:
    text: str  # the model's turn as it wrote it (end-of-turn not included)
    calls: list  # ToolCall parsed from it
    errors: list[str]  # text that meant to be a call but did not parse
    conversation: list[dict]  # every message so far, this turn last


@dataclass
class ToolResult:
    name: str
    content: str
    error: bool = False


@dataclass
class Reply:
    results: list[ToolResult] = field(default_factory=list)  # rendered as tool messages, in order
    messages: list[dict] = field(default_factory=list)  # further messages (e.g. a user's), after the results
    done: bool = False
    reward: float | None = None  # the environment's own reward when done (reward=env reads it)


class Environment:
    """Base class: `TOOLS` (JSON schemas), `reset`, `step`, optionally `correct`."""

    TOOLS: list[dict] = []

    def __init__(self, cfg):
        self.cfg = cfg
        self.max_turns = int(cfg["max_turns"])
        self.tools = tool_fmt.check_schemas(self.TOOLS, f"env.name={cfg['name']}: TOOLS") if self.TOOLS else []

    def reset(self, row: dict):
        return {"row": row}

    def prompt(self, state, prompt: list[dict]) -> list[dict]:
        """The episode's opening messages: the row's prompt (a server that poses the task itself
        can put its own text there, workbench/envs/openenv.py)."""
        return prompt

    def step(self, state, turn: Turn) -> Reply:
        raise NotImplementedError

    def end(self, state) -> None:
        """The episode is over (ended, cut or abandoned): release what reset took (a session)."""

    def correct(self, state, conversation: list[dict]) -> bool | None:
        return None

    def demonstrate(self, row: dict, fmt) -> list[str] | None:
        """The assistant turns of a good episode for `row`, in the call format `fmt` (what
        `data.preview=true` runs through the episode loop to show the masks); None: no demo."""
        return None


class ToolEnv(Environment):
    """Tool use: each call runs, a turn without one ends the episode (`finish` scores it)."""

    def call(self, state, name: str, arguments: dict) -> str:
        raise NotImplementedError

    def finish(self, state, turn: Turn) -> float | None:
        return None

    def step(self, state, turn: Turn) -> Reply:
        if not turn.calls and not turn.errors:
            return Reply(done=True, reward=self.finish(state, turn))
        results = [ToolResult("error", f"error: could not read the tool call: {e}", True) for e in turn.errors]
        for c in turn.calls:
            problem = tool_fmt.arguments_problem(c, self.tools)
            if problem:
                results.append(ToolResult(c.name, f"error: {problem}", True))
                continue
            try:
                results.append(ToolResult(c.name, str(self.call(state, c.name, c.arguments))))
            except Exception as exc:  # noqa: BLE001 - the model reads what went wrong, as a tool's answer
                results.append(ToolResult(c.name, f"error: {exc}", True))
        return Reply(results=results)


def final_answer(conversation: list[dict]) -> str | None:
    """The episode's final answer: its last message, when that is a finished assistant turn
    without a tool call; None when the episode ended on a call, a turn cut at max_new_tokens, or
    something else."""
    last = conversation[-1] if conversation else {}
    if last.get("role") != "assistant" or any(last.get(k) for k in ("tool_calls", "tool_call_errors", "truncated")):
        return None
    return str(last.get("content", "")).strip()


def is_tool_result(message: dict) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_result"))


def answered_after_tool(conversation: list[dict]) -> bool:
    """Whether the final answer follows a tool result (the message before it)."""
    return final_answer(conversation) is not None and len(conversation) >= 2 and is_tool_result(conversation[-2])


def check_node(node) -> dict:
    """The env config node as a dict, its common keys checked (UserError naming the field)."""
    if node is None:
        raise UserError("env: no environment chosen; add env=calc (conf/env/) or env.name=package.module:Class")
    cfg = dict(node)
    cfg.setdefault("max_turns", 4)
    cfg.setdefault("max_new_tokens", 64)
    for key in ("recipe", "eval_path", "tool_format"):
        cfg.setdefault(key, None)
    for key, kind in COMMON.items():
        if key not in cfg:
            raise UserError(f"env.{key}: missing")
        if not isinstance(cfg[key], kind) or isinstance(cfg[key], bool):
            raise UserError(f"env.{key}: expected {getattr(kind, '__name__', 'a string or null')}, got {cfg[key]!r}")
    for key in ("max_turns", "max_new_tokens"):
        if cfg[key] < 1:
            raise UserError(f"env.{key} must be >= 1 (got {cfg[key]})")
    if cfg["tool_format"] is not None and cfg["tool_format"] not in tool_fmt.FORMATS:
        raise UserError(f"env.tool_format={cfg['tool_format']!r} is not one of {sorted(tool_fmt.FORMATS)} (or null: "
                        "the chat template's own)")
    return cfg
