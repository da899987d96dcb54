"""The tool-calling text format: reading a model's turn, and the text the model reads back.

The model calls a tool by emitting (Hermes/Qwen style) one JSON object in tags:

    <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>

and the env replies with the result as the next observation (mask 0, not trained):

    <tool_response>21</tool_response>

It ends the episode with a final answer:

    <answer>21</answer>

Parsing is tolerant where a small model is sloppy: whitespace anywhere, a missing
closing tag, text around the JSON; a line starting with "Final answer:" also counts
as the answer. Only strict JSON is accepted inside <tool_call> (no single quotes);
anything else is reported back to the model as an error observation.

- `parse_action`: one turn's text -> `ToolCall`, `FinalAnswer`, `ParseError` or None;
- `describe_tools`: the system-prompt text teaching this format, with a worked example;
- `format_result` / `ToolObservation`: a tool's return value as the text the model reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union

from tinkerless.envs.tool_schema import Tool, _placeholder_arguments


# ---------------------------------------------------------------------------
# parsing the model's text


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class FinalAnswer:
    text: str


@dataclass
class ParseError:
    """The text tried to call a tool but the call could not be read; `message` is shown to the model."""

    message: str


Action = Union[ToolCall, FinalAnswer, ParseError, None]

_TOOL_CALL_OPEN = re.compile(r"<\s*tool_call\s*>", re.IGNORECASE)
_TOOL_CALL_CLOSE = re.compile(r"<\s*/\s*tool_call\s*>", re.IGNORECASE)
_ANSWER_OPEN = re.compile(r"<\s*answer\s*>", re.IGNORECASE)
_ANSWER_CLOSE = re.compile(r"<\s*/\s*answer\s*>", re.IGNORECASE)
_FINAL_ANSWER_LINE = re.compile(r"^[ \t]*final answer\s*:[ \t]*(.*)$", re.IGNORECASE | re.MULTILINE)


def parse_action(text: str) -> Action:
    """Read one action from a model turn: the first <tool_call> or <answer>, else a "Final answer:" line, else None.

    A tag without its closing tag runs to the end of the text (the reply may have
    hit the token limit). Only the first tool call of a turn is read.
    """
    call = _TOOL_CALL_OPEN.search(text)
    answer = _ANSWER_OPEN.search(text)
    if call and (answer is None or call.start() < answer.start()):
        return _parse_call(_tag_body(text, call, _TOOL_CALL_CLOSE))
    if answer:
        return FinalAnswer(_tag_body(text, answer, _ANSWER_CLOSE).strip())
    line = _FINAL_ANSWER_LINE.search(text)
    if line:
        return FinalAnswer(line.group(1).strip())
    return None


def _tag_body(text: str, opening: re.Match, closing: re.Pattern) -> str:
    end = closing.search(text, opening.end())
    return text[opening.end() : end.start() if end else len(text)]


def _parse_call(body: str) -> ToolCall | ParseError:
    start = body.find("{")
    if start < 0:
        return ParseError('no JSON object inside <tool_call>; write <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    try:
        payload, _ = json.JSONDecoder().raw_decode(body, start)
    except json.JSONDecodeError as exc:
        return ParseError(f"invalid JSON in <tool_call>: {exc.msg} at character {exc.pos - start}; use double quotes")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ParseError('the tool call needs a "name" string: {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI-style arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ParseError('"arguments" is a string that is not valid JSON; pass a JSON object')
    if not isinstance(arguments, dict):
        return ParseError(f'"arguments" must be a JSON object, got {type(arguments).__name__}')
    return ToolCall(name=payload["name"], arguments=arguments)


# ---------------------------------------------------------------------------
# describing tools to the model


def describe_tools(tools: list[Tool]) -> str:
    """System-prompt text: each tool with its JSON parameters, the exact call/answer format and one worked example."""
    lines = ["You can call these tools:"]
    for t in tools:
        lines.append(f"- {t.name}: {t.description}")
        lines.append(f"  parameters: {json.dumps(t.parameters)}")
    lines += [
        "",
        "To call a tool, reply with only:",
        '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>',
        "The result comes back as <tool_response>...</tool_response>.",
        "When you know the answer, reply with:",
        "<answer>YOUR ANSWER</answer>",
    ]
    if tools:
        lines += ["", "Example:", *_worked_example(tools[0])]
    return "\n".join(lines)


def _worked_example(t: Tool) -> list[str]:
    call = json.dumps({"name": t.name, "arguments": t.example if t.example is not None else _placeholder_arguments(t)})
    result = "..."
    if t.example is not None:
        try:  # tools are meant to be pure functions, so running the example shows its real output
            result = format_result(t(**t.example))
        except Exception:
            result = "..."
    return [f"<tool_call>{call}</tool_call>", f"<tool_response>{result}</tool_response>", f"<answer>{result}</answer>"]


@dataclass(frozen=True)
class ToolObservation:
    """What a tool returns when the outcome is more than a value: the text the model reads, and whether the call
    succeeded. A program that hit a limit is `ToolObservation(text, ok=False)`: the model reads what happened and
    the episode goes on; the call counts as failed for partial credit and `tool_errors`."""

    text: str
    ok: bool = True


def format_result(value: Any) -> str:
    """A tool's return value as observation text: strings as they are, other values as JSON where possible."""
    if isinstance(value, ToolObservation):
        return value.text
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
