"""Tools for multi-turn episodes: declared as JSON schemas, called in the text a model writes.

    tools.check_schemas(schemas, "env.tools")            # UserError naming the bad field
    fmt = tools.format_for(tokenizer)                     # the template family's call format
    calls, errors = fmt.parse(text)                       # ToolCall(name, arguments) per call
    fmt.render(ToolCall("calc", {"expression": "3 * 4"}))  # the text a demonstration writes

Schemas follow the Hugging Face `tools=` chat-template convention (the OpenAI function format):
`{"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON schema
of an object>}}`; `parameters` is checked against the JSON-schema meta-schema (jsonschema).

A call is parsed from the model's own text by its chat template's family:
- `hermes` (ChatML templates: SmolLM2, Qwen2/2.5/3, Hermes): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, any number per turn. Qwen's templates render calls this way; SmolLM2's
  template has no tool format of its own, so the workbench uses this documented convention for
  it too (and describes the tools in a system message, workbench/rollout/turns.py).
- `llama3` (Llama 3.1/3.2/3.3 templates): one JSON object `{"name": ..., "parameters": {...}}`,
  after `<|python_tag|>` or bare as the whole turn (Meta's JSON-based tool calling); a JSON list
  of such objects is several calls.
Text that is meant as a call but does not parse (bad JSON, no name, unknown tool, arguments that
do not fit the schema) is an error the environment hands back as the tool's answer, so the
model can see what went wrong; the episode's metrics count such errors.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from workbench.core.errors import UserError


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


def check_schemas(schemas, where: str = "env.tools") -> list[dict]:
    """The tool schemas as plain dicts, or a UserError naming the first field that is wrong."""
    if not isinstance(schemas, (list, tuple)) or not schemas:
        raise UserError(f"{where}: expected a non-empty list of tool schemas "
                        '({"type": "function", "function": {"name", "description", "parameters"}})')
    out, names = [], set()
    for i, s in enumerate(schemas):
        at = f"{where}[{i}]"
        if not isinstance(s, dict) or s.get("type") != "function" or not isinstance(s.get("function"), dict):
            raise UserError(f"{at}: expected {{'type': 'function', 'function': {{...}}}} (got {s!r:.80})")
        fn = s["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise UserError(f"{at}.function.name: a tool needs a name of letters, digits and _ (got {name!r})")
        if name in names:
            raise UserError(f"{at}.function.name: {name!r} is declared twice")
        names.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        problem = schema_problem(params)
        if problem:
            raise UserError(f"{at}.function.parameters: not a valid JSON schema: {problem}")
        if params.get("type") != "object":
            raise UserError(f"{at}.function.parameters: must describe an object (\"type\": \"object\"), "
                            f"got type {params.get('type')!r}")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def schema_problem(schema) -> str | None:
    """Why `schema` is not a valid JSON schema (draft 2020-12 meta-schema), or None."""
    if not isinstance(schema, dict):
        return f"expected an object, got {type(schema).__name__}"
    try:
        import jsonschema
    except ImportError:  # the structural minimum without the package
        kinds = ("object", "array", "string", "number", "integer", "boolean", "null")
        t = schema.get("type")
        bad = [x for x in (t if isinstance(t, list) else [t]) if t is not None and x not in kinds]
        return f"type {bad[0]!r} is not one of {list(kinds)}" if bad else None
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path)
        return f"{exc.message}" + (f" (at {path})" if path else "")
    return None


def arguments_problem(call: ToolCall, schemas: list[dict]) -> str | None:
    """Why `call` does not fit the declared tools (unknown name, arguments off-schema), or None."""
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    if call.name not in by_name:
        return f"unknown tool {call.name!r}; tools are {sorted(by_name)}"
    params = by_name[call.name].get("parameters") or {}
    try:
        import jsonschema
    except ImportError:
        missing = [k for k in params.get("required", []) if k not in call.arguments]
        return f"missing argument(s) {missing}" if missing else None
    err = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(params).iter_errors(call.arguments))
    return None if err is None else f"arguments of {call.name!r}: {err.message}"


def _loads(text: str):
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        # some of json's messages end in "at" already ("Unterminated string starting at")
        return None, f"not JSON ({exc.msg.removesuffix(' at')} at character {exc.pos})"


def _call(obj, arg_keys: tuple[str, ...]) -> tuple[ToolCall | None, str | None]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'a tool call is a JSON object with a "name"'
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args, err = _loads(args)
        if err:
            return None, f"arguments {err}"
    if not isinstance(args, dict):
        return None, f'"{arg_keys[0]}" must be an object'
    return ToolCall(obj["name"], args), None


class Hermes:
    """`<tool_call>{json}</tool_call>`: ChatML templates (SmolLM2, Qwen, Hermes)."""

    family = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls, errors = [], []
        for body, close in self._BLOCK.findall(text):
            if not close:
                errors.append("a <tool_call> without its closing </tool_call>")
                continue
            obj, err = _loads(body.strip())
            call, err = (None, err) if err else _call(obj, ("arguments", "parameters"))
            (errors.append(err) if err else calls.append(call))
        return calls, errors

    def render(self, call: ToolCall) -> str:
        return f"{self.OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{self.CLOSE}"


class Llama3:
    """Llama 3.1+ JSON tool calls: `<|python_tag|>{json}` or the whole turn a JSON object."""

    family = "llama3"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        body = text.strip()
        tagged = body.startswith(self.TAG)
        if tagged:
            body = body[len(self.TAG):].strip()
        elif not body.startswith(("{", "[")):
            return [], []  # plain text: an answer, not a call
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.removesuffix(end).strip()
        obj, err = _loads(body)
        if err:
            # bare text that merely starts with a brace is an answer unless it looks like a call
            return ([], [err]) if tagged or '"name"' in body else ([], [])
        calls, errors = [], []
        for item in obj if isinstance(obj, list) else [obj]:
            call, err = _call(item, ("parameters", "arguments"))
            (errors.append(err) if err else calls.append(call))
        return calls, errors

    def render(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": call.arguments})


FORMATS = {"hermes": Hermes, "llama3": Llama3}


def family_of(template: str | None) -> str:
    """The tool-call family a chat template speaks: llama3 for Llama 3 header templates, else
    hermes (ChatML and Qwen render `<tool_call>`; a template without a format gets that one)."""
    t = template or ""
    if "<|start_header_id|>" in t or "<|python_tag|>" in t:
        return "llama3"
    return "hermes"


def format_for(tokenizer, family: str | None = None):
    """The call format for `tokenizer`'s chat template (or the named family)."""
    family = family or family_of(getattr(tokenizer, "chat_template", None))
    if family not in FORMATS:
        raise UserError(f"env.tool_format={family!r} is not one of {sorted(FORMATS)}")
    return FORMATS[family]()


def describe(schemas: list[dict], fmt) -> str:
    """A system message declaring the tools, for templates that do not render `tools=` themselves
    (SmolLM2's): each tool's function object (name, description, parameters) as compact JSON in a
    <tools> block, and how to call one, in the Hermes/Qwen wording, kept short because every
    episode's prompt carries it."""
    lines = "\n".join(json.dumps(s["function"], separators=(",", ":")) for s in schemas)
    example = fmt.render(ToolCall("...", {})).replace('"..."', "...").replace("{}", "{...}")
    return f"Tools (call one with {example}; its result comes back as a tool message):\n<tools>\n{lines}\n</tools>"
