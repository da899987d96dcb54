"""A safe calculator tool, math word problems, and `CalculatorEnv`: the tool-calling starter env.

The calculator walks the expression's syntax tree (`ast`), so only numbers,
+ - * / **, unary signs and parentheses are ever evaluated: no names, calls or
attributes, and bounded sizes so `9**9**9` is an error, not a hang.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from typing import Any, Callable

from tinkerless.envs.tools import ToolEnv, tool
from tinkerless.envs.decorators import env

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 100  # beyond this a word problem has gone wrong; also bounds big-int work


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message is written for the model to read."""


_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, or CalculatorError saying why not."""
    # A trailing "=" and the × ÷ signs are common in model output and unambiguous.
    text = expression.strip().rstrip("= ").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression; write something like 3 * (4 + 5)")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression!r}; use numbers, + - * / ** and parentheses") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression is nested too deeply") from None
    try:
        return _eval(tree.body)
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{_describe(node)} is not allowed; use numbers, + - * / ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    # Estimate the size before computing: int powers are exact and can take forever.
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent} too large (limit {MAX_EXPONENT})")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
        raise CalculatorError("result too large")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")


def _checked(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result too large")
    if abs(value) >= 10**MAX_RESULT_DIGITS:
        raise CalculatorError("result too large")
    return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Attribute):
        return "attribute access"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        return f"the operator {type(node.op).__name__}"
    return f"{type(node).__name__}"


def format_number(value: int | float) -> str:
    """Whole results without a trailing .0 (word-problem answers are integers), others to 10 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".10g")
    return str(value)


@tool(example={"expression": "3 * 7"})
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers, + - * / ** and parentheses.

    Args:
        expression: the expression, e.g. (12 - 5) * 3
    """
    return format_number(evaluate(expression))


# ---------------------------------------------------------------------------
# word problems: small numbers, two or three operations, integer answers

_NAMES = ["Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Ivy"]


def _apples(rng: random.Random, name: str) -> tuple[str, int, str]:
    boxes, per_box = rng.randint(2, 9), rng.randint(3, 15)
    eaten = rng.randint(1, boxes * per_box - 1)
    return (
        f"{name} has {boxes} boxes of {per_box} apples and eats {eaten}. How many apples are left?",
        boxes * per_box - eaten,
        f"{boxes} * {per_box} - {eaten}",
    )


def _change(rng: random.Random, name: str) -> tuple[str, int, str]:
    price, count = rng.randint(2, 9), rng.randint(2, 6)
    bill = next(b for b in (20, 50, 100) if b > price * count)
    return (
        f"A pen costs {price} dollars. {name} buys {count} pens and pays with a {bill} dollar bill. "
        f"How many dollars of change does {name} get?",
        bill - price * count,
        f"{bill} - {price} * {count}",
    )


def _reading(rng: random.Random, name: str) -> tuple[str, int, str]:
    per_day, days = rng.randint(5, 20), rng.randint(2, 7)
    total = per_day * days + rng.randint(10, 90)
    return (
        f"{name} reads {per_day} pages a day for {days} days. The book has {total} pages. How many pages are left?",
        total - per_day * days,
        f"{total} - {per_day} * {days}",
    )


def _groups(rng: random.Random, name: str) -> tuple[str, int, str]:
    groups, size = rng.randint(2, 9), rng.randint(2, 12)
    return (
        f"{name}'s class has {groups * size} students split equally into {groups} groups. "
        "How many students are in each group?",
        size,
        f"{groups * size} / {groups}",
    )


def _trip(rng: random.Random, name: str) -> tuple[str, int, str]:
    speed, hours, extra = rng.randint(20, 90), rng.randint(2, 5), rng.randint(5, 50)
    return (
        f"{name} drives {speed} km per hour for {hours} hours, then {extra} km more. How many km is that in total?",
        speed * hours + extra,
        f"{speed} * {hours} + {extra}",
    )


def _stickers(rng: random.Random, name: str) -> tuple[str, int, str]:
    had, got = rng.randint(5, 40), rng.randint(2, 30)
    got += (had + got) % 2  # an even total halves evenly
    return (
        f"{name} had {had} stickers, got {got} more, then gave away half of them. How many stickers does {name} have now?",
        (had + got) // 2,
        f"({had} + {got}) / 2",
    )


# Each template returns (question, answer, an expression the calculator evaluates to the answer).
TEMPLATES: list[Callable[[random.Random, str], tuple[str, int, str]]] = [_apples, _change, _reading, _groups, _trip, _stickers]


def solved_word_problem(rng: random.Random) -> tuple[dict, str]:
    """A word problem `{"question": str, "answer": int}` from a random template, and the expression that solves it."""
    template = rng.choice(TEMPLATES)
    question, answer, expression = template(rng, rng.choice(_NAMES))
    return {"question": question, "answer": answer}, expression


def make_word_problem(rng: random.Random) -> dict:
    """A task `{"question": str, "answer": int}`: two or three operations the model must read out of the story."""
    return solved_word_problem(rng)[0]


# ---------------------------------------------------------------------------
# calculation problems: one operation on numbers too large to guess, the expression stated in the question
# (the easier task distribution: a small model learns to hand it to the calculator within a few RL steps)

_OPERATIONS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
_PHRASINGS = ["What is {expression}?", "Compute {expression}.", "How much is {words}?", "Calculate {expression}."]


def solved_calculation_problem(rng: random.Random) -> tuple[dict, str]:
    """"What is 347 * 29?": a task `{"question": str, "answer": int}` and its expression.

    Operands have 2-4 digits so the product, sum or difference is not something a
    135M model gets right by guessing; divisions are exact, so every answer is an integer.
    """
    symbol = rng.choice(list(_OPERATIONS))
    if symbol == "*":
        left, right = rng.randint(12, 999), rng.randint(12, 99)
    elif symbol == "/":
        right = rng.randint(3, 99)
        left = right * rng.randint(12, 999)
    elif symbol == "+":
        left, right = rng.randint(100, 9999), rng.randint(100, 9999)
    else:  # a difference of at least 10: no 4567 - 4566
        right = rng.randint(100, 4999)
        left = rng.randint(right + 10, 9999)
    expression = f"{left} {symbol} {right}"
    words = f"{left} {_OPERATIONS[symbol]} {right}"
    question = rng.choice(_PHRASINGS).format(expression=expression, words=words)
    answer = evaluate(expression)
    return {"question": question, "answer": int(answer)}, expression


def make_calculation_problem(rng: random.Random) -> dict:
    """A task `{"question": str, "answer": int}` with one stated operation ("What is 347 * 29?")."""
    return solved_calculation_problem(rng)[0]


# ---------------------------------------------------------------------------
# the env

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number in a text ("... so 31 are left." -> 31); answers tend to end with the result."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


@env
class CalculatorEnv(ToolEnv):
    """Math problems with a calculator. Reward, with partial credit so a small model has signal:

    - 1.0: the last number in the final answer is the right one;
    - 0.5: not answered right, but a calculator call returned the right number;
    - 0.3: answered with a number a calculator call returned, but a wrong one (the tool's
      result was used, the expression was wrong);
    - 0.2: not answered right, but the calculator was called with a well-formed expression;
    - 0.1: a <tool_call> was attempted but could not be run (bad JSON, unknown tool, bad arguments);
    - 0.0: otherwise.

    The 0.3 step separates "called, then answered with the result" from "called and never
    answered": without it, a group in which every episode makes a well-formed call with a
    wrong expression scores a flat 0.2 and has no advantage to learn from.

    The question ends with a one-line format `reminder`: SmolLM2-135M ignores the
    format in the system prompt, but with the reminder about a third of its replies
    try a <tool_call>, which the 0.1 step of the ladder then reinforces.
    """

    tools = [calculator]
    max_tool_calls = 2  # below a typical max_turns of 3, so the env ends episodes itself
    instructions = (
        "Solve the math problem. Call the calculator to compute, "
        "then give the final number in <answer></answer> tags."
    )
    reminder = "Reply with a <tool_call> to the calculator, or with <answer>NUMBER</answer>."

    def reset(self, question: str, answer: int) -> str:
        self.question = question
        self.answer = answer
        return f"{question}\n\n{self.reminder}" if self.reminder else question

    def score(self, answer: str) -> float:
        number = last_number(answer)
        if number is not None and math.isclose(number, self.answer):
            return 1.0
        return self.partial_credit(answered=number)

    def out_of_tool_calls(self) -> float:
        return self.partial_credit(answered=None)

    def partial_credit(self, answered: float | None) -> float:
        good = [c for c in self.calls if c.ok and c.name == calculator.name]
        results = [last_number(c.result) for c in good]
        if self.answer in results:
            return 0.5
        if answered is not None and answered in results:
            return 0.3
        if good:
            return 0.2
        return 0.1 if self.calls else 0.0


# ---------------------------------------------------------------------------
# demonstrations: correct tool-using episodes for an SFT warm start


Solver = Callable[[random.Random], "tuple[dict, str]"]


def make_demonstration(rng: random.Random, env_cls: type | None = None, problems: Solver = solved_word_problem) -> dict:
    """One correct episode as SFT chat data `{"messages": [...]}`, played through the env itself.

    The system prompt, the first user message and the tool's response are the env's own
    (exactly what a rollout shows the model); the two assistant turns are a well-formed
    calculator call with the expression that solves the problem, and `<answer>N</answer>`.
    The episode is checked to earn reward 1.0, so a demonstration is never wrong.
    `problems` is the task generator with its solution (`solved_word_problem`,
    `solved_calculation_problem`): demonstrations come from the distribution RL trains on.
    """
    env_cls = env_cls or CalculatorEnv
    task, expression = problems(rng)
    env = env_cls()
    messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.reset(**task)}]
    call = json.dumps({"name": calculator.name, "arguments": {"expression": expression}})
    messages.append({"role": "assistant", "content": f"<tool_call>{call}</tool_call>"})
    observed = env.step(messages[-1]["content"])
    messages.append({"role": "user", "content": str(observed.observation)})
    messages.append({"role": "assistant", "content": f"<answer>{task['answer']}</answer>"})
    final = env.step(messages[-1]["content"])
    if not (final.done and final.reward == 1.0):  # a template whose expression does not give its answer
        raise AssertionError(f"demonstration for {task} scored {final.reward}, not 1.0")
    return {"messages": messages, "task": task}


def make_demonstrations(count: int, seed: int = 0, env_cls: type | None = None, problems: Solver = solved_word_problem) -> list[dict]:
    """`count` demonstrations (`make_demonstration`), reproducible from `seed`."""
    return [make_demonstration(random.Random(f"demo:{seed}:{i}"), env_cls, problems) for i in range(count)]


__all__ = [
    "CalculatorEnv",
    "CalculatorError",
    "TEMPLATES",
    "calculator",
    "evaluate",
    "format_number",
    "last_number",
    "make_calculation_problem",
    "make_demonstration",
    "make_demonstrations",
    "make_word_problem",
    "solved_calculation_problem",
    "solved_word_problem",
]
