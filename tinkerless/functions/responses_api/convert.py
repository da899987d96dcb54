"""Responses `input`, `instructions` and `tools` to the chat messages and tools the model's template renders.

  * `input` as a string is one user message; as items, each `message` item is a chat message (its input_text /
    output_text parts joined), consecutive `function_call` items are the `tool_calls` of one assistant message
    (the assistant message just before them, when there is one), and a `function_call_output` is a `tool` message;
  * a user message's `input_image` parts (`"image_url": "data:image/...;base64,..."`) keep the message's content
    a list of parts, which `wire.content.to_parts` reads and checks (a URL or a `file_id` is a 400: a server never
    fetches, and keeps no files); such a conversation is rendered by the model's processor (`openai_api.vision`);
  * `instructions` is the system message, first (never carried over by `previous_response_id`, as OpenAI's);
  * function tools (`{"type": "function", "name", "parameters"}`) are Chat Completions' function tools.
So a conversation rendered here is token for token the same conversation sent to /v1/chat/completions.
"""

from __future__ import annotations

import json
from typing import Any

from tinkerless.functions.openai_api.backend import OpenAIError
from tinkerless.functions.openai_api.render import check_tools

_TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")


def _text(content: Any, where: str) -> str:
    """A message item's (or a function output's) content as text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}[{j}] is a {str(kind)[:40]!r} part: this server reads text parts only",
                              param=f"{where}[{j}]", code="unsupported_content",
                              hint='send {"type": "input_text", "text": "..."} parts or a string')
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{where}.{key} must be a non-empty string", param=f"{where}.{key}")
    return value


def _parts(content: Any, where: str) -> str | list[dict]:
    """A user message's content: its text, or (when it holds `input_image` parts) its parts in order, as chat
    content parts (`{"type": "text"}`, `{"type": "image_url"}`)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                 for p in content):
        return _text(content, where)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url.startswith("data:"):
                given = "file_id" if "file_id" in part else "image_url"
                raise OpenAIError(f"{where}[{j}] is an input_image without a data URL ({given}): this server takes "
                                  f"images inline only and never fetches a URL or a file", param=f"{where}[{j}]",
                                  code="invalid_image", hint='send "image_url": "data:image/png;base64,..."')
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text([part], where)})
    return parts


def items_to_chat(items: Any) -> list[dict]:
    """The chat messages of `input` (without `instructions`)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise OpenAIError("input must be a string or a list of items", param="input")
    chat: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise OpenAIError(f"{where}.role {str(role)[:40]!r} is not one of {', '.join(ROLES)}",
                                  param=f"{where}.role", code="invalid_role")
            read = _parts if role == "user" else _text
            chat.append({"role": "system" if role == "developer" else role,
                         "content": read(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            arguments = item.get("arguments", "{}")
            if not isinstance(arguments, str):
                raise OpenAIError(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": arguments}}
            previous = chat[-1] if chat else None
            if previous is not None and previous["role"] == "assistant":
                previous.setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            chat.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(output, f"{where}.output")})
        else:
            raise OpenAIError(f"{where} is a {str(kind)[:40]!r} item: this server takes message, function_call and "
                              f"function_call_output items", param=f"{where}.type", code="unsupported_item")
    for message in chat:  # a tool call's arguments must be JSON, as render_chat reads them
        for call in message.get("tool_calls") or ():
            try:
                json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError:
                raise OpenAIError(f"the function_call {call['id'][:60]!r} has arguments that are not JSON",
                                  param="input", code="invalid_tool_arguments") from None
    return chat


def to_tools(tools: list[Any] | None) -> list[dict]:
    """Responses function tools as checked Chat Completions function tools (`strict: true` is enforced under
    tool_choice auto by the router: `render.strict_tools_grammar`)."""
    converted = []
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise OpenAIError(f"tools[{i}] is a {str(kind)[:40]!r} tool: this server runs no built-in tools; define "
                              f"a function tool", param=f"tools[{i}]", code="unsupported_tool")
        converted.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}})
    try:
        return check_tools(converted)
    except OpenAIError as exc:  # its param names Chat Completions' fields: say it in Responses'
        param = (exc.param or "tools").replace(".function", "")
        raise OpenAIError(exc.message.replace(exc.param or "", param), param=param, code=exc.code) from None


def tools_for_choice(tool_choice: Any, tools: list[dict]) -> list[dict]:
    """The tools the template is given: none for "none"; all otherwise ("required" and a named function are asked
    of the model as Chat Completions asks them: rendered, not forced). A named function not in tools is a 400."""
    if tool_choice == "none":
        return []
    if isinstance(tool_choice, dict):
        name = tool_choice.get("name")
        if tool_choice.get("type") != "function" or not any(t["function"]["name"] == name for t in tools):
            raise OpenAIError(f"tool_choice {json.dumps(tool_choice)[:120]} names no function of tools",
                              param="tool_choice")
    return tools
