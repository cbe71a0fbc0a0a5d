"""env=calc: arithmetic the model cannot do in its head, with a calculator tool it learns to use.

    python -m workbench method=sft data.recipe=calc_sft_mixed train.max_steps=20   # warm start on demonstrations
    python -m workbench method=grpo env=calc model.path=<warm start>/export/merged

Tasks (workbench/data/calc.py): 3-digit addition and 2-digit multiplication, held-out
questions in data_recipes/data/calc_eval.jsonl. One tool, `calc(expression)`, evaluated by
`evaluate` below: the expression is parsed with `ast` and only numbers, + - * / // % **,
unary signs and parentheses are walked; nothing is ever passed to eval(). Exponents, operand
sizes and the expression's length are bounded so a sampled expression cannot stall a rollout.
A turn without a tool call is the final answer; `correct` compares it, stripped, with the row's
`answer` (reward=final_answer scores the same thing from the conversation).
"""

from __future__ import annotations

import ast
import operator
import re

from workbench.envs.base import ToolEnv, Turn, final_answer
from workbench.envs.tools import ToolCall

MAX_CHARS = 200
MAX_MAGNITUDE = 10**18
MAX_EXPONENT = 64
_EXPRESSION = re.compile(r"What is (\d+ [-+*/] \d+)\?")

TOOL = {"type": "function", "function": {
    "name": "calc",
    "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate; its message goes to the model."""


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text: an integer when the value is whole
    ("936"), else a decimal ("2.5"). CalcError for anything else."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalcError("empty expression")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression!r}") from None
    value = _walk(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _walk(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_walk(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, TypeError):
            raise CalcError("the result is out of range") from None
    raise CalcError(f"only numbers, + - * / // % ** and parentheses are allowed (found {type(node).__name__})")


def _bounded(value):
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise CalcError("the result is out of range")
    return value


class Calculator(ToolEnv):
    TOOLS = [TOOL]

    def reset(self, row: dict):
        return {"answer": str(row.get("answer", "")).strip()}

    def call(self, state, name: str, arguments: dict) -> str:
        return evaluate(arguments["expression"])

    def finish(self, state, turn: Turn) -> float | None:
        return None  # scored by the run's reward functions (reward=final_answer), which see the conversation

    def correct(self, state, conversation: list[dict]) -> bool:
        return final_answer(conversation) == state["answer"]

    def demonstrate(self, row: dict, fmt) -> list[str] | None:
        """Call calc on the question's expression, then answer with its result."""
        found = _EXPRESSION.search(row["prompt"][-1]["content"])
        if not found:
            return None
        expression = found.group(1)
        return [fmt.render(ToolCall("calc", {"expression": expression})), evaluate(expression)]
