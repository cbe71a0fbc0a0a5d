"""Tool calls per chat-template family, tool schemas, and the calculator's safe evaluator.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_tools.py
"""

from __future__ import annotations

import pytest

from workbench.core.errors import UserError
from workbench.envs import tools
from workbench.envs.calculator import TOOL, CalcError, evaluate
from workbench.envs.tools import Hermes, Llama3, ToolCall

CALC = ToolCall("calc", {"expression": "347 + 589"})


# -- hermes: ChatML templates (SmolLM2's convention, Qwen's own) ------------------------------------
def test_hermes_parses_one_call_with_text_around_it():
    calls, errors = Hermes().parse('Let me compute.\n<tool_call>{"name": "calc", "arguments": {"expression": '
                                   '"347 + 589"}}</tool_call>')
    assert calls == [CALC] and errors == []


def test_hermes_parses_several_calls_and_qwen_layout():
    text = ('<tool_call>\n{"name": "calc", "arguments": {"expression": "1 + 2"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"3 * 4\\"}"}\n</tool_call>')
    calls, errors = Hermes().parse(text)
    assert calls == [ToolCall("calc", {"expression": "1 + 2"}), ToolCall("calc", {"expression": "3 * 4"})]
    assert errors == []


@pytest.mark.parametrize("text,why", [
    ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}', "closing"),
    ("<tool_call>{name: calc}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>', "must be an object"),
])
def test_hermes_reports_broken_calls(text, why):
    calls, errors = Hermes().parse(text)
    assert calls == [] and len(errors) == 1 and why in errors[0]


def test_hermes_plain_answer_is_no_call():
    assert Hermes().parse("936") == ([], [])


def test_hermes_render_parses_back():
    fmt = Hermes()
    assert fmt.parse(fmt.render(CALC)) == ([CALC], [])


# -- llama3: Llama 3.1+ JSON tool calling ---------------------------------------------------------
def test_llama3_parses_python_tag_and_bare_json():
    fmt = Llama3()
    tagged = '<|python_tag|>{"name": "calc", "parameters": {"expression": "347 + 589"}}<|eom_id|>'
    bare = '{"name": "calc", "parameters": {"expression": "347 + 589"}}'
    assert fmt.parse(tagged) == ([CALC], [])
    assert fmt.parse(bare) == ([CALC], [])
    assert fmt.parse(fmt.render(CALC)) == ([CALC], [])


def test_llama3_list_of_calls_and_errors():
    fmt = Llama3()
    calls, errors = fmt.parse('[{"name": "calc", "parameters": {"expression": "1"}}, {"parameters": {}}]')
    assert calls == [ToolCall("calc", {"expression": "1"})] and len(errors) == 1
    assert fmt.parse('<|python_tag|>{"name": "calc", "parameters": ') [1]  # tagged but broken: an error
    assert fmt.parse("The answer is 936.") == ([], [])


def test_family_detection_from_the_template():
    assert tools.family_of("{{ '<|im_start|>' + message['role'] }}") == "hermes"
    assert tools.family_of("{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}") == "llama3"
    assert tools.family_of(None) == "hermes"


# -- schemas --------------------------------------------------------------------------------------
def test_schemas_are_checked_against_json_schema():
    assert tools.check_schemas([TOOL])[0]["function"]["name"] == "calc"
    bad_type = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                            "properties": {"x": {"type": "strng"}}}}}
    with pytest.raises(UserError, match=r"env.tools\[0\].function.parameters: not a valid JSON schema"):
        tools.check_schemas([bad_type])
    with pytest.raises(UserError, match="must describe an object"):
        tools.check_schemas([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    with pytest.raises(UserError, match="declared twice"):
        tools.check_schemas([TOOL, TOOL])
    with pytest.raises(UserError, match=r"\[0\]: expected"):
        tools.check_schemas([{"name": "calc"}])


def test_arguments_are_checked_against_the_tool():
    schemas = tools.check_schemas([TOOL])
    assert tools.arguments_problem(CALC, schemas) is None
    assert "unknown tool" in tools.arguments_problem(ToolCall("sql", {}), schemas)
    assert "expression" in tools.arguments_problem(ToolCall("calc", {}), schemas)
    assert "not of type" in tools.arguments_problem(ToolCall("calc", {"expression": 3}), schemas)


# -- the calculator -------------------------------------------------------------------------------
@pytest.mark.parametrize("expr,value", [("347 + 589", "936"), ("47 * 86", "4042"), ("(2 + 3) * -4", "-20"),
                                        ("7 / 2", "3.5"), ("8 / 2", "4"), ("2 ** 10", "1024"), ("17 // 5 % 3", "0")])
def test_calculator_evaluates_arithmetic(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr,why", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("9 ** 9 ** 9", "exponent"), ("10 ** 60 * 10 ** 60", "out of range"), ("1 +", "cannot parse"), ("", "empty"),
    ("1" * 201, "longer than"), ("'a' * 3", "only numbers"), ("[1, 2]", "only numbers"), ("1e300 * 1e300", "range"),
])
def test_calculator_refuses_everything_else(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)
