"""Chat messages and tools to prompt token ids, and a model's reply text to content + `tool_calls`.

Pure functions over a HF tokenizer, shared by `tinkerless serve` and the rollout worker's agent endpoint.

Tools are rendered by the model's own chat template when the template reads `tools` (Qwen2.5,
Llama 3.1, Hermes...). A template that ignores them (SmolLM2's) gets the schemas the way the built-in
`ToolEnv` shows them (`tinkerless.envs.tools.describe_tools`, in the system message), so a model trained
on ToolEnv sees the same text. Either way a tool call in the reply is the Hermes/ToolEnv format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed by ToolEnv's own parser.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from typing import Any

from tinkerless.envs.tools import Tool, ToolCall, _TOOL_CALL_CLOSE, _TOOL_CALL_OPEN, _parse_call, describe_tools
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.openai_api.backend import OpenAIError

ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_formats: dict[int, tuple[Any, ChatFormat]] = {}
_formats_lock = threading.Lock()


def chat_format(tokenizer) -> ChatFormat:
    """The tokenizer's `ChatFormat` (end-of-turn ids, plain transcript for a template-less model), built once."""
    with _formats_lock:
        entry = _formats.get(id(tokenizer))
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, ChatFormat(tokenizer))
            _formats[id(tokenizer)] = entry
        return entry[1]


def template_supports_tools(tokenizer) -> bool:
    """Whether the chat template reads a `tools` variable (one that does not would silently drop them)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the "tool_use" one is used when tools are given
        return "tool_use" in template or any("tools" in t for t in template.values() if isinstance(t, str))
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def check_tools(tools: list[Any] | None) -> list[dict]:
    """OpenAI tool definitions, checked: `[{"type": "function", "function": {"name", "description"?, "parameters"?}}]`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list of tool definitions", param="tools", code="unsupported_tool")
    checked = []
    for i, entry in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type", "function") != "function":
            kind = entry.get("type") if isinstance(entry, dict) else type(entry).__name__
            raise OpenAIError(
                f"{where} is a {str(kind)[:40]!r} tool: this server renders function tools only",
                param=where, code="unsupported_tool",
                hint='pass {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            )
        function = entry.get("function")
        if not isinstance(function, dict):
            raise OpenAIError(f"{where}.function must be an object with a name", param=f"{where}.function",
                              code="unsupported_tool")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise OpenAIError(
                f"{where}.function.name {str(name)[:80]!r} is not a valid function name",
                param=f"{where}.function.name", code="unsupported_tool", hint="use 1-64 letters, digits, '_' or '-'",
            )
        description = function.get("description", "")
        if description is not None and not isinstance(description, str):
            raise OpenAIError(f"{where}.function.description must be a string", param=f"{where}.function.description",
                              code="unsupported_tool")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or not isinstance(parameters.get("properties", {}), dict):
            raise OpenAIError(
                f"{where}.function.parameters must be a JSON-schema object (with an object of properties)",
                param=f"{where}.function.parameters", code="unsupported_tool",
                hint='e.g. {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}',
            )
        checked.append({"type": "function", "function": {"name": name, "description": description or "",
                                                         "parameters": parameters}})
    return checked


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    f"{where}.content[{j}] is a {str(kind)[:40]!r} part: this model reads text parts only",
                    param=f"{where}.content", hint='send {"type": "text", "text": "..."} parts or a string',
                )
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


def _call_of(call: Any, where: str) -> tuple[str, dict]:
    """A tool call's (name, arguments as an object): OpenAI sends the arguments as a JSON string."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise OpenAIError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise OpenAIError(f"{where}.function.arguments is not valid JSON", param=f"{where}.function.arguments",
                              code="invalid_tool_arguments") from None
    if not isinstance(arguments, dict):
        raise OpenAIError(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments",
                          code="invalid_tool_arguments")
    return function["name"], arguments


def normalize_messages(messages: Any, *, template_tools: bool) -> list[dict]:
    """OpenAI messages as the dicts a chat template reads. Without template tool support, tool calls become
    ToolEnv's `<tool_call>` text and tool results `<tool_response>` user turns, as ToolEnv writes them."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    out: list[dict] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise OpenAIError(f"{where} must be an object with a role", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise OpenAIError(f"{where}.role {str(role)[:40]!r} is not one of {', '.join(ROLES)}", param=f"{where}.role",
                              code="invalid_role")
        text = _text_of(message.get("content"), where)
        role = "system" if role == "developer" else role
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is not None and not isinstance(calls, list):
            raise OpenAIError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
        parsed = [_call_of(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls or [])]
        if template_tools:
            entry: dict = {"role": role, "content": text}
            if parsed:
                entry["tool_calls"] = [
                    {"id": c.get("id"), "type": "function", "function": {"name": name, "arguments": args}}
                    for c, (name, args) in zip(calls, parsed)
                ]
            if role == "tool":
                entry["tool_call_id"] = message.get("tool_call_id")
                if isinstance(message.get("name"), str):
                    entry["name"] = message["name"]
            out.append(entry)
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>{text}</tool_response>"})
        else:
            blocks = [f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in parsed]
            out.append({"role": role, "content": "\n".join([text, *blocks]) if text and blocks else text or "\n".join(blocks)})
    return out


def template_messages(tokenizer, messages: Any, tools: list[Any] | None = None) -> tuple[list[dict], list[dict] | None]:
    """(the messages the chat template is given, the tools it is given) for an OpenAI request.

    The one step between an agent's messages and the template: `render_chat` tokenizes its result, and
    anything that must equal what the router renders (SFT demonstrations of an agent's calls) uses it too.
    Without template tool support the tools come back as None, described in the system message instead.
    """
    checked = check_tools(tools)
    template_tools = bool(checked) and template_supports_tools(tokenizer)
    rendered = normalize_messages(messages, template_tools=template_tools)
    if checked and not template_tools:  # ToolEnv's description, in (or as) the system message
        description = describe_tools([Tool(t["function"]["name"], t["function"]["description"],
                                           t["function"]["parameters"], fn=None) for t in checked])
        if rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{description}"}
        else:
            rendered.insert(0, {"role": "system", "content": description})
    return rendered, (checked if template_tools else None)


def render_chat(tokenizer, messages: Any, tools: list[Any] | None = None, *, continue_final: bool = False) -> list[int]:
    """The prompt token ids of `messages` (+ `tools`) with the generation prompt, as the model's template writes them.

    With `continue_final` (a prefill: the last message is the assistant's start of its reply), that message is
    rendered open, as the template writes it up to its end-of-turn, and the reply continues it."""
    rendered, template_tools = template_messages(tokenizer, messages, tools)
    has_tools = bool(tools)  # checked by template_messages: a non-empty list of function tools
    fmt = chat_format(tokenizer)
    if continue_final and (rendered[-1]["role"] != "assistant" or rendered[-1].get("tool_calls")):
        raise OpenAIError("only a last assistant turn of text can be continued", param="messages",
                          code="unsupported_prefill", hint="end with a user turn, or an assistant turn of text")
    if not fmt.has_template:
        if continue_final:  # the plain transcript of `ChatFormat.render`, its last "assistant: ..." line left open
            return fmt.encode("\n".join(f"{m['role']}: {m['content']}" for m in rendered))
        return fmt.prompt_tokens(rendered)
    try:
        text = tokenizer.apply_chat_template(
            rendered, tools=template_tools, add_generation_prompt=not continue_final,
            continue_final_message=continue_final, tokenize=False
        )
    except Exception as exc:  # a template error is about what the caller sent (roles, order, schemas)
        raise OpenAIError(
            f"the model's chat template cannot render these messages{' and tools' if has_tools else ''}: "
            f"{type(exc).__name__}: {str(exc)[:300]}",
            param="tools" if has_tools else "messages", code="unrenderable_request",
            hint="check the message roles and order and the tool schemas this model's template expects",
        ) from None
    return fmt.encode(text)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a reply: every `<tool_call>{json}</tool_call>` that ToolEnv's parser reads
    becomes an OpenAI tool call; everything else (unreadable calls included) stays content."""
    calls: list[dict] = []
    kept: list[str] = []
    position = 0
    while True:
        opening = _TOOL_CALL_OPEN.search(text, position)
        if opening is None:
            break
        closing = _TOOL_CALL_CLOSE.search(text, opening.end())
        end = closing.end() if closing else len(text)  # an unclosed tag runs to the end (cut at max_tokens)
        parsed = _parse_call(text[opening.end():closing.start() if closing else len(text)])
        if isinstance(parsed, ToolCall):
            kept.append(text[position:opening.start()])
            calls.append({
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": parsed.name, "arguments": json.dumps(parsed.arguments)},
            })
        else:
            kept.append(text[position:end])
        position = end
    kept.append(text[position:])
    # With calls, trailing whitespace before them goes (the glue of "text\n<tool_call>"); leading whitespace stays
    # when text follows it, as a stream must send it before it can know a call comes (streaming.py): the two agree.
    if not calls:
        return (text or None), calls
    return ("".join(kept).rstrip() or None), calls


def strict_tool_names(tools: Any, *, nested: bool) -> set[str]:
    """The names of the tools a request marks `strict: true` (Chat Completions: `tools[i].function.strict`; Responses
    and Messages: `tools[i].strict`), read from the raw (already checked) tools; strictness is kept out of the
    tools the template renders, so marking a tool strict never changes its prompt."""
    names = set()
    for tool in tools if isinstance(tools, list) else ():
        entry = tool.get("function") if nested and isinstance(tool, dict) else tool
        if isinstance(entry, dict) and entry.get("strict") is True and isinstance(entry.get("name"), str):
            names.add(entry["name"])
    return names


def _call_schemas(functions: list[dict], strict: set[str] | None = None) -> dict:
    """The JSON schema of one tool call's JSON, `{"name": ..., "arguments": {...}}`, of any of `functions`: the
    arguments follow the tool's parameters (with `strict`, only the named tools' do; the others' are any object)."""
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "arguments": f["parameters"] if strict is None or f["name"] in strict else {"type": "object"}},
        "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return {"anyOf": calls, "x-guidance": {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}}


def strict_tools_grammar(tools: list[dict], strict: set[str]) -> str:
    """A Lark grammar (llguidance's) for a reply under tool_choice auto with `strict: true` tools: free text, in which
    every `<tool_call>` the model opens is a call of one of `tools` whose arguments follow its parameters when the
    tool is strict. The text before each call is a lazy lexeme ending at the first `<tool_call>` (llguidance's
    pattern for tool calls in running text, its `StructTag`), so no unchecked call can hide in the text."""
    schema = _call_schemas([t["function"] for t in tools], strict)
    return ('start: call* tail\ntail: TEXT\nTEXT: /(.|\\n)*/\nopening[lazy]: TEXT "<tool_call>"\n'
            f'call: opening %json {json.dumps(schema)} "</tool_call>"')


def tool_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """A Lark grammar (llguidance's, `sampling.constraints`) for a reply that is exactly one tool call in the format
    `parse_tool_calls` reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the arguments following
    the tool's parameters schema. With `name`, that tool only; else any of `tools` (checked OpenAI function tools)."""
    schema = _call_schemas([t["function"] for t in tools if name is None or t["function"]["name"] == name])
    return f'start: "<tool_call>" call "</tool_call>"\ncall: %json {json.dumps(schema)}'

