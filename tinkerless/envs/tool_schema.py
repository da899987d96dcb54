"""`@tool`: a typed Python function as a `Tool` the model may call.

The JSON schema the model sees is read from the function itself: argument types from its
annotations (str, int, float, bool, list, dict, optionally `| None`), the description from
its docstring's first paragraph, per-argument text from a Google-style "Args:" section.
`Tool.bind` checks a call's arguments against that schema, coercing what a model plausibly
meant ("3" for 3) and raising `ToolCallError`, naming the bad argument, for the rest.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Union

from tinkerless.errors import UserCodeError, UserError

# Python annotation -> JSON-schema type name. bool before int: bool is an int subclass.
_JSON_TYPES: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}


class ToolCallError(UserError):
    """A tool was called with missing, unknown or mistyped arguments."""


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


# Sample arguments of the right types: the call shown to a model that left one out (ToolCallError's hint) and,
# for a tool without an `example`, in describe_tools' worked example.
def _placeholder_arguments(t: Tool) -> dict:
    samples = {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    out = {}
    for key, schema in t.parameters.get("properties", {}).items():
        declared = schema.get("type", "string")
        json_type = next(n for n in (declared if isinstance(declared, list) else [declared]) if n != "null")
        out[key] = samples.get(json_type, "text")
    return out

