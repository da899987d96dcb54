"""Anthropic Messages requests to the chat messages and tools the model's template renders (`openai_api.render`).

An Anthropic conversation maps onto chat messages one for one, except for tool results:
  * `system` (a string or text blocks) is the system message;
  * a user turn's `tool_result` blocks become `tool` messages (in order, before the turn's other blocks,
    which become one user message), so a template renders them as it renders Chat Completions' tool results;
  * an assistant turn's `text` blocks are its content and its `tool_use` blocks its `tool_calls`
    (`input` as the JSON arguments), so a reply sent back renders exactly as the Chat Completions one does.
`content_parts` is the one place a content block becomes a message part. A user turn's `image` blocks
(`{"type": "image", "source": {"type": "base64", "media_type", "data"}}`) stay in the user message's content, as
parts that `wire.content.to_parts` reads and checks (a `url` source is a 400: a server never fetches); such a
conversation is rendered by the model's processor (`openai_api.vision`), or refused by a text-only model.
A last assistant turn is a prefill: `to_chat` reports it, and the reply continues that turn (`render_chat`'s
`continue_final`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinkerless.functions.openai_api.backend import OpenAIError
from tinkerless.functions.openai_api.render import check_tools

_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def content_parts(content: Any, where: str, *, allowed: tuple[str, ...] = ("text",)) -> list[dict]:
    """A message's (or a tool result's) content as chat content parts: a string, or a list of blocks."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise OpenAIError(f"{where} must be a string or a list of content blocks", param=where)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind not in allowed:
            raise OpenAIError(
                f"{where}.{j} is a {str(kind)[:40]!r} block, which this server does not take here "
                f"(it takes {', '.join(allowed)} blocks)", param=f"{where}.{j}.type", code="unsupported_content",
                hint="send text blocks; images need a vision model")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise OpenAIError(f"{where}.{j}.text must be a string", param=f"{where}.{j}.text")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":  # checked where it is read (`to_parts`): here only the source a server never fetches
            source = block.get("source")
            if not isinstance(source, dict) or source.get("type") != "base64":
                kind = source.get("type") if isinstance(source, dict) else type(source).__name__
                raise OpenAIError(f"{where}.{j}.source is a {str(kind)[:40]!r} source: this server takes base64 "
                                  f"images only and never fetches a URL", param=f"{where}.{j}.source",
                                  code="invalid_image", hint='send {"type": "base64", "media_type", "data"}')
            parts.append({"type": "image", "source": source})
        else:
            parts.append(block)  # tool_use / tool_result: read by the caller
    return parts


def _text(parts: list[dict]) -> str:
    return "".join(p["text"] for p in parts if p["type"] == "text")


def _system(system: Any) -> list[dict]:
    if system is None:
        return []
    text = _text(content_parts(system, "system"))
    return [{"role": "system", "content": text}] if text else []


def _tool_result(block: dict, where: str) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise OpenAIError(f"{where}.tool_use_id must name the tool_use block it answers", param=f"{where}.tool_use_id")
    content = block.get("content", "")
    text = _text(content_parts(content, f"{where}.content")) if content is not None else ""
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tool_use(block: dict, where: str) -> dict:
    name, arguments, call_id = block.get("name"), block.get("input", {}), block.get("id")
    if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
        raise OpenAIError(f"{where} must be {{'type': 'tool_use', 'id': str, 'name': str, 'input': object}}",
                          param=where)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def to_chat(system: Any, messages: list[Any]) -> tuple[list[dict], bool]:
    """(the chat messages, OpenAI's shape, as `render_chat` reads them, of an Anthropic request; whether its last
    turn is an assistant prefill the reply continues)."""
    chat = _system(system)
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise OpenAIError(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role", code="invalid_role")
        role = message["role"]
        allowed = ("text", "image", "tool_result") if role == "user" else ("text", "tool_use")
        parts = content_parts(message.get("content"), f"{where}.content", allowed=allowed)
        if role == "assistant":
            calls = [_tool_use(p, f"{where}.content.{j}") for j, p in enumerate(parts) if p["type"] == "tool_use"]
            entry: dict = {"role": "assistant", "content": _text(parts) or (None if calls else "")}
            if calls:
                entry["tool_calls"] = calls
            chat.append(entry)
            continue
        chat.extend(_tool_result(p, f"{where}.content.{j}") for j, p in enumerate(parts) if p["type"] == "tool_result")
        rest = [p for p in parts if p["type"] != "tool_result"]
        if any(p["type"] == "image" for p in rest):  # parts, in order, for the model's processor
            chat.append({"role": "user", "content": rest})
        elif rest or not any(p["type"] == "tool_result" for p in parts):
            chat.append({"role": "user", "content": _text(rest)})
    prefill = bool(chat) and chat[-1]["role"] == "assistant"
    if prefill and (chat[-1].get("tool_calls") or not chat[-1]["content"]):
        raise OpenAIError("the last message is an assistant turn without text (or with tool_use blocks): only a "
                          "text prefill can be continued", param=f"messages.{len(messages) - 1}",
                          code="unsupported_prefill", hint="end with a user turn, or an assistant turn of text")
    return chat, prefill


def to_tools(tools: list[Any] | None) -> list[dict]:
    """Anthropic client tools (`name`, `description`, `input_schema`) as checked OpenAI function tools."""
    if not tools:
        return []
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type", "custom") if isinstance(tool, dict) else type(tool).__name__
        if kind != "custom" or not isinstance(tool, dict):
            raise OpenAIError(f"{where} is a {str(kind)[:60]!r} tool: this server runs no server tools; define it as "
                              f"a client tool (name, description, input_schema)", param=where, code="unsupported_tool")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise OpenAIError(f"{where}.name {str(name)[:80]!r} is not a valid tool name", param=f"{where}.name",
                              code="unsupported_tool", hint="use 1-64 letters, digits, '_' or '-'")
        if "input_schema" not in tool:
            raise OpenAIError(f"{where}.input_schema is required", param=f"{where}.input_schema", code="unsupported_tool")
        converted.append({"type": "function", "function": {"name": name, "description": tool.get("description"),
                                                           "parameters": tool["input_schema"]}})
    try:
        return check_tools(converted)
    except OpenAIError as exc:  # its param names OpenAI's fields: say it in Anthropic's
        param = (exc.param or "tools").replace("tools[", "tools.").replace("]", "").replace(".function.parameters",
                                                                                              ".input_schema")
        raise OpenAIError(exc.message.replace(exc.param or "", param), param=param, code=exc.code) from None


def tools_for_choice(tool_choice: dict[str, Any] | None, tools: list[dict]) -> list[dict]:
    """The tools the template is given under `tool_choice`: none for {"type": "none"}; all of them otherwise.

    "any" and {"type": "tool", "name"} are asked of the model the way Chat Completions' "required" is (the tools
    are rendered; the reply is not forced): a name no tool has is a 400."""
    if tool_choice is None:
        return tools
    kind = tool_choice.get("type")
    if kind == "none":
        return []
    if kind in ("auto", "any"):
        return tools
    if kind == "tool":
        name = tool_choice.get("name")
        if not any(t["function"]["name"] == name for t in tools):
            raise OpenAIError(f"tool_choice names the tool {str(name)[:80]!r}, which is not in tools",
                              param="tool_choice.name")
        return tools
    raise OpenAIError(f"tool_choice.type {str(kind)[:40]!r} is not one of auto, any, tool, none",
                      param="tool_choice.type")
