"""Tool calling for the agent loop: `@tool`, the call/answer text format, and `ToolEnv`.

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

`ToolEnv` implements the protocol; subclasses provide `tools`, `reset(**task)` and
`score(answer)`. A reply with neither a tool call nor an answer is scored as if
the whole reply were the answer, so a model that never learned the tags still
gets a reward signal.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Union

from tinkerless.envs.base import StepResult
from tinkerless.envs.sandbox.limits import SandboxUnavailable
from tinkerless.errors import EnvError, UserCodeError, UserError

# A tool that cannot run on this machine at all ends the run loudly instead of becoming an
# observation: a missing sandbox must never turn into episodes that silently fail every call.
TOOL_UNAVAILABLE: tuple[type[BaseException], ...] = (SandboxUnavailable,)

# Python annotation -> JSON-schema type name. bool before int: bool is an int subclass.
_JSON_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


class ToolCallError(UserError):
    """A tool was called with missing, unknown or mistyped arguments."""


# ---------------------------------------------------------------------------
# @tool


@dataclass
class Tool:
    """A function the model may call. `parameters` is a JSON-schema object describing its arguments."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]
    example: dict | None = None  # arguments shown in the worked example of describe_tools()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(**self.bind(*args, **kwargs))

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Check and coerce arguments against `parameters`; raise ToolCallError naming the bad one."""
        properties: dict[str, dict] = self.parameters.get("properties", {})
        names = list(properties)
        if len(args) > len(names):
            raise ToolCallError(
                f"tool {self.name!r} takes {len(names)} argument(s), got {len(args)} positional",
                hint=f"pass arguments by name: {', '.join(names) or '(none)'}",
            )
        given = dict(zip(names, args))
        for key, value in kwargs.items():
            if key in given:
                raise ToolCallError(f"tool {self.name!r} got argument {key!r} twice", hint="pass each argument once")
            given[key] = value
        unknown = [key for key in given if key not in properties]
        if unknown:
            raise ToolCallError(
                f"tool {self.name!r} has no argument {unknown[0]!r}",
                hint=f"its arguments are: {', '.join(names) or '(none)'}",
            )
        missing = [key for key in self.parameters.get("required", []) if key not in given]
        if missing:
            raise ToolCallError(
                f"tool {self.name!r} is missing required argument {missing[0]!r}",
                hint=f"call it as {json.dumps({'name': self.name, 'arguments': _placeholder_arguments(self)})}",
            )
        return {key: _coerce(self.name, key, value, properties[key]) for key, value in given.items()}


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None, description: str | None = None, example: dict | None = None
) -> Any:
    """Turn a type-annotated function into a `Tool`: `@tool` or `@tool(name=..., description=..., example={...})`.

    Arguments may be str, int, float, bool, list or dict (optionally `| None`);
    those with defaults are optional. The docstring's first paragraph is the
    description the model sees; a Google-style "Args:" section describes arguments.
    """
    if fn is None:
        return lambda f: tool(f, name=name, description=description, example=example)
    return _make_tool(fn, name=name, description=description, example=example)


def _make_tool(fn: Callable[..., Any], *, name: str | None, description: str | None, example: dict | None) -> Tool:
    label = getattr(fn, "__qualname__", repr(fn))
    if not inspect.isfunction(fn):
        raise UserCodeError(f"@tool decorates a plain function, got {type(fn).__name__} {fn!r}", hint="def my_tool(x: int) -> str: ...")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation names something undefined
        raise UserCodeError(f"cannot read the annotations of tool {label!r}: {exc}", hint="annotate with str, int, float, bool, list or dict") from exc
    doc = inspect.getdoc(fn) or ""
    summary, arg_docs = _parse_docstring(doc)
    description = description or summary
    if not description:
        raise UserCodeError(
            f"tool {label!r} has no docstring",
            hint="the docstring is what the model reads to decide when to call the tool; describe what it does",
        )
    properties: dict[str, dict] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UserCodeError(
                f"tool {label!r} takes *{param.name}; tools need named arguments",
                hint="list every argument explicitly, e.g. def my_tool(a: int, b: int) -> int",
            )
        if param.name not in hints:
            raise UserCodeError(
                f"argument {param.name!r} of tool {label!r} has no type annotation",
                hint=f"annotate it, e.g. `{param.name}: str`; the model sees the types in the tool's JSON schema",
            )
        schema = _schema_for(hints[param.name], f"argument {param.name!r} of tool {label!r}")
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        if param.default is param.empty:
            required.append(param.name)
        else:
            schema["default"] = param.default
        properties[param.name] = schema
    made = Tool(
        name=name or fn.__name__,
        description=description,
        parameters={"type": "object", "properties": properties, "required": required},
        fn=fn,
        example=example,
    )
    if example is not None:
        made.bind(**example)  # a bad example would teach the model a bad call
    return made


def _schema_for(annotation: Any, where: str) -> dict:
    nullable = False
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        nullable = len(members) < len(typing.get_args(annotation))
        if len(members) != 1:
            raise UserCodeError(f"{where} has a union type {annotation}", hint="use a single type, optionally `| None`")
        annotation = members[0]
        origin = typing.get_origin(annotation)
    base = origin or annotation  # list[int] -> list
    if base not in _JSON_TYPES:
        raise UserCodeError(f"{where} has unsupported type {annotation!r}", hint="use str, int, float, bool, list or dict")
    json_type = _JSON_TYPES[base]
    return {"type": [json_type, "null"] if nullable else json_type}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """First paragraph, and `name: text` lines of an "Args:" section."""
    summary = doc.split("\n\n", 1)[0].strip().replace("\n", " ")
    args: dict[str, str] = {}
    section = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if section:
        for line in section.group(1).splitlines():
            match = re.match(r"\s+(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)", line)
            if match:
                args[match.group(1)] = match.group(2).strip()
    if summary.startswith(("Args:", "Arguments:", "Parameters:")):
        summary = ""
    return summary, args


def _coerce(tool_name: str, arg: str, value: Any, schema: dict) -> Any:
    """Coerce what a model plausibly meant ("3" for 3) and reject the rest with a clear error."""
    declared = schema.get("type", "string")
    names = declared if isinstance(declared, list) else [declared]
    if value is None and "null" in names:
        return None
    json_type = next(n for n in names if n != "null")
    converted = _convert(value, json_type)
    if converted is _INVALID:
        raise ToolCallError(
            f"tool {tool_name!r} argument {arg!r}: expected {json_type}, got {value!r} ({type(value).__name__})",
            hint=f"pass {arg!r} as a JSON {json_type}",
        )
    return converted


_INVALID = object()


def _convert(value: Any, json_type: str) -> Any:
    if json_type == "string":
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # {"expression": 21} meant "21"
        return _INVALID
    if json_type == "boolean":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        return _INVALID
    if json_type == "integer":
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return _INVALID
            return int(number) if number.is_integer() else _INVALID
        return _INVALID
    if json_type == "number":
        if isinstance(value, bool):
            return _INVALID
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                return _INVALID
        return _INVALID
    container = list if json_type == "array" else dict
    if isinstance(value, container):
        return value
    if isinstance(value, str):  # a JSON-encoded container, as some chat formats send
        try:
            decoded = json.loads(value)
        except ValueError:
            return _INVALID
        return decoded if isinstance(decoded, container) else _INVALID
    return _INVALID


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


def _placeholder_arguments(t: Tool) -> dict:
    samples = {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    out = {}
    for key, schema in t.parameters.get("properties", {}).items():
        declared = schema.get("type", "string")
        json_type = next(n for n in (declared if isinstance(declared, list) else [declared]) if n != "null")
        out[key] = samples.get(json_type, "text")
    return out


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


# ---------------------------------------------------------------------------
# the env


@dataclass
class ToolCallRecord:
    """One attempted call in an episode. `ok` is True when the tool ran and returned."""

    name: str
    arguments: dict
    ok: bool
    result: str


class ToolEnv:
    """Base class for tool-using envs. Subclass, set `tools`, implement `reset(**task)` and `score(answer)`.

        @tinkerless.env
        class MathEnv(ToolEnv):
            tools = [calculator]
            def reset(self, question, answer): self.answer = answer; return question
            def score(self, answer): return float(str(self.answer) in answer)

    Each turn: a tool call runs the tool and answers `<tool_response>...</tool_response>`
    (reward 0; a tool that raises answers `error: ...` and the episode goes on, except
    TOOL_UNAVAILABLE errors, which end the run); an
    unknown tool, bad arguments or unreadable call answers an error and costs
    `format_penalty`; an answer ends the episode with `score(answer)`. Every attempted
    call counts towards `max_tool_calls`; one more ends the episode with
    `out_of_tool_calls()` (0 by default). A turn with neither a call nor an answer
    is scored as if the whole text were the answer.
    """

    tools: ClassVar[list[Tool]] = []
    max_tool_calls: ClassVar[int] = 4
    format_penalty: ClassVar[float] = 0.0
    max_response_chars: ClassVar[int] = 1000  # long tool outputs are cut to keep episodes within the token budget
    instructions: ClassVar[str] = "Solve the task. Use a tool when it helps, then give your final answer."

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Mistakes in the class definition surface at import, not in the middle of a rollout.
        if not isinstance(cls.tools, (list, tuple)):
            raise UserCodeError(f"{cls.__qualname__}.tools must be a list of tools, got {type(cls.tools).__name__}", hint="tools = [my_tool]")
        for item in cls.tools:
            if not isinstance(item, Tool):
                raise UserCodeError(
                    f"{cls.__qualname__}.tools holds {item!r}, which is not a Tool",
                    hint="decorate each tool function with @tinkerless.tool",
                )
        names = [t.name for t in cls.tools]
        if len(set(names)) != len(names):
            raise UserCodeError(f"{cls.__qualname__}.tools has duplicate names: {names}", hint="give each tool a unique name")
        if not isinstance(cls.max_tool_calls, int) or cls.max_tool_calls < 0:
            raise UserCodeError(f"{cls.__qualname__}.max_tool_calls must be an int >= 0, got {cls.max_tool_calls!r}")

    # Per-episode history, created on first use so subclasses need not call super().__init__().
    @property
    def calls(self) -> list[ToolCallRecord]:
        return self.__dict__.setdefault("_tool_calls", [])

    def system_prompt(self) -> str:
        return f"{self.instructions}\n\n{describe_tools(self.tools)}"

    def score(self, answer: str) -> float:
        raise EnvError(
            f"{type(self).__qualname__} does not define score(answer)",
            hint="a ToolEnv subclass implements score(self, answer: str) -> float for the final answer",
        )

    def out_of_tool_calls(self) -> float:
        """Reward when the episode ends because the model kept calling tools; override for partial credit."""
        return 0.0

    def step(self, action: str) -> StepResult:
        parsed = parse_action(action)
        if parsed is None:
            parsed = FinalAnswer(action.strip())
        if isinstance(parsed, FinalAnswer):
            return StepResult(None, reward=self.score(parsed.text), done=True, info=self._info(answered=1))
        if len(self.calls) >= self.max_tool_calls:
            return StepResult(None, reward=self.out_of_tool_calls(), done=True, info=self._info(answered=0, out_of_tool_calls=1))
        if isinstance(parsed, ParseError):
            self.calls.append(ToolCallRecord(name="", arguments={}, ok=False, result=parsed.message))
            return self._respond(f"error: {parsed.message}", penalty=True)
        return self._run(parsed)

    def _run(self, call: ToolCall) -> StepResult:
        by_name = {t.name: t for t in self.tools}
        chosen = by_name.get(call.name)
        if chosen is None:
            message = f"unknown tool {call.name!r}; available tools: {', '.join(by_name) or 'none'}"
            self.calls.append(ToolCallRecord(call.name, call.arguments, ok=False, result=message))
            return self._respond(f"error: {message}", penalty=True)
        try:
            arguments = chosen.bind(**call.arguments)
        except ToolCallError as exc:
            self.calls.append(ToolCallRecord(call.name, call.arguments, ok=False, result=exc.message))
            return self._respond(f"error: {exc.message}", penalty=True)
        try:
            value = chosen.fn(**arguments)
            result = format_result(value)
        except TOOL_UNAVAILABLE:
            raise
        except Exception as exc:  # a failing tool is information for the model, not a crashed episode
            message = str(exc) or type(exc).__name__
            self.calls.append(ToolCallRecord(call.name, arguments, ok=False, result=message))
            return self._respond(f"error: {message}", penalty=False)
        ok = value.ok if isinstance(value, ToolObservation) else True
        self.calls.append(ToolCallRecord(call.name, arguments, ok=ok, result=result))
        return self._respond(result, penalty=False)

    def _respond(self, text: str, *, penalty: bool) -> StepResult:
        if len(text) > self.max_response_chars:
            text = text[: self.max_response_chars] + "...(truncated)"
        reward = -abs(self.format_penalty) if penalty else 0.0
        return StepResult(f"<tool_response>{text}</tool_response>", reward=reward, done=False, info=self._info())

    def _info(self, **extra: int) -> dict:
        return {"tool_calls": len(self.calls), "tool_errors": sum(not c.ok for c in self.calls), **extra}


__all__ = [
    "Action",
    "FinalAnswer",
    "ParseError",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallRecord",
    "ToolEnv",
    "ToolObservation",
    "TOOL_UNAVAILABLE",
    "describe_tools",
    "format_result",
    "parse_action",
    "tool",
]
