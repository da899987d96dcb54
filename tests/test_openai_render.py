"""Chat + tools rendering and tool-call parsing of the OpenAI routes (`openai_api.render`), and `tool_calls` in
replies read by the official client.

Tool calls use ToolEnv's format on both sides: a template without tool support gets ToolEnv's tool
description, and `<tool_call>{json}</tool_call>` in a reply is read by ToolEnv's own parser.
"""

from __future__ import annotations

import copy
import json

import openai
import pytest
from fastapi import FastAPI
from hypothesis import given, settings, strategies as st

from tinkerless.envs.tools import ToolCall, parse_action
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.server import serve_in_thread
from tinkerless.server.openai_api import OpenAIError, SampledChoice, openai_router, parse_tool_calls, render_chat
from tinkerless.functions.openai_api.render import template_supports_tools

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

# A template that reads `tools` and tool calls (the Hermes/Qwen2.5 layout, shortened).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(worker):
    return worker.tokenizer


def test_parse_tool_calls_reads_toolenv_format(tokenizer):
    content, calls = parse_tool_calls('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                      '{"expression": "3 * 7"}}</tool_call>')
    assert content == "Let me compute."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("calculator", {"expression": "3 * 7"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    # Several calls, arguments as a JSON string (OpenAI style), a call cut at max_tokens (no closing tag).
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>'
                                '<tool_call> {"name": "b", "arguments": {}} ')
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    # What ToolEnv would reject stays text: no tool call is made up.
    for text in ("<tool_call>{'name': 'a'}</tool_call>", "<tool_call>no json</tool_call>", "plain answer",
                 '<tool_call>{"arguments": {}}</tool_call>'):
        assert parse_tool_calls(text) == (text, [])


_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True)
_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                       lambda inner: st.lists(inner, max_size=3), max_leaves=6)
_text = st.text(max_size=30).filter(lambda t: "<" not in t)


@settings(max_examples=150, deadline=None)
@given(_names, st.dictionaries(st.text(max_size=8), _values, max_size=4), _text, _text)
def test_every_call_toolenv_reads_is_the_openai_tool_call(name, arguments, before, after):
    text = f"{before}<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>{after}"
    action = parse_action(text)
    content, calls = parse_tool_calls(text)
    assert isinstance(action, ToolCall)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (action.name, action.arguments)]
    outside = before + after  # trailing whitespace cut; leading kept (a stream sends it before it sees a call)
    assert content == (outside.rstrip() if outside.strip() else None)


def test_a_template_without_tools_gets_toolenv_descriptions_and_formats(tokenizer):
    assert not template_supports_tools(tokenizer)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 3 * 7?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "calculator", "arguments": '{"expression": "3 * 7"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"},
    ]
    text = tokenizer.decode(render_chat(tokenizer, messages, [CALC]))
    from tinkerless.envs.tools import Tool, describe_tools

    description = describe_tools([Tool("calculator", "Evaluate arithmetic.", CALC["function"]["parameters"], None)])
    expected = ChatFormat(tokenizer).render([
        {"role": "system", "content": "Be brief.\n\n" + description},
        {"role": "user", "content": "What is 3 * 7?"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>'},
        {"role": "user", "content": "<tool_response>21</tool_response>"},
    ])
    assert text == expected
    # Without tools the prompt is the template's own rendering (what the agent loop sends).
    assert render_chat(tokenizer, messages[:2]) == ChatFormat(tokenizer).prompt_tokens(messages[:2])


def test_a_template_with_tools_renders_them_itself(tokenizer):
    tools_tokenizer = copy.deepcopy(tokenizer)
    tools_tokenizer.chat_template = TOOLS_TEMPLATE
    assert template_supports_tools(tools_tokenizer)
    messages = [{"role": "user", "content": "3 * 7?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3*7"}'}}]},
                {"role": "tool", "tool_call_id": "c", "content": "21"}]
    text = tools_tokenizer.decode(render_chat(tools_tokenizer, messages, [CALC]))
    assert json.dumps(CALC["function"]["name"]) in text and '"Evaluate arithmetic."' in text
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "3*7"}}</tool_call>' in text
    # A template that cannot render the request is the caller's 400, not a 500.
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = "{% if tools %}{{ raise_exception('this template takes no tools') }}{% endif %}" + TOOLS_TEMPLATE
    with pytest.raises(OpenAIError) as caught:
        render_chat(broken, messages, [CALC])
    assert caught.value.status == 400 and caught.value.code == "unrenderable_request"
    assert "this template takes no tools" in caught.value.message


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}], "tools[0].function.parameters"),
    ([{"type": "function"}], "tools[0].function"),
    ("calculator", "tools"),
])
def test_unrenderable_tool_schemas_are_refused(tokenizer, tools, param):
    with pytest.raises(OpenAIError) as caught:
        render_chat(tokenizer, [{"role": "user", "content": "hi"}], tools)
    assert caught.value.status == 400 and caught.value.param == param


class ScriptedModel:
    """A backend whose model always replies `reply` (then its end of turn): the router is what is tested here."""

    def __init__(self, tokenizer, reply: str):
        self._tokenizer = tokenizer
        self.ids = tokenizer.encode(reply, add_special_tokens=False) + [ChatFormat(tokenizer).end_of_turn_id]
        self.prompts: list[list[int]] = []

    def tokenizer(self):
        return self._tokenizer

    def models(self, caller):
        return ["scripted"]

    async def sample(self, caller, model, request):
        self.prompts.append(request.prompt_ids)
        ids = self.ids[: request.max_tokens]
        return [SampledChoice(ids, [-0.5] * len(ids), None, ids[-1] in request.stop_token_ids)] * request.n


def test_tool_calls_reach_the_openai_client(tokenizer):
    reply = 'Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>'
    model = ScriptedModel(tokenizer, reply)
    app = FastAPI()
    app.include_router(openai_router(model, caller=lambda request: "episode-1"))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="episode-1", max_retries=0)
        messages = [{"role": "user", "content": "What is 3 * 7?"}]
        answer = client.chat.completions.create(model="scripted", messages=messages, tools=[CALC], max_tokens=200)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
        call = choice.message.tool_calls[0]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "3 * 7"}
        assert answer.usage.completion_tokens == len(model.ids)  # the end-of-turn token was drawn too

        stream = client.chat.completions.create(model="scripted", messages=messages, tools=[CALC], max_tokens=200,
                                                stream=True)
        streamed, reason, content = {}, None, ""
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                streamed[part.index] = (part.function.name, json.loads(part.function.arguments))
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls" and content == "Sure." and streamed == {0: ("calculator", {"expression": "3 * 7"})}

        # The agent sends the call and its result back: both are rendered as ToolEnv writes them.
        client.chat.completions.create(model="scripted", tools=[CALC], max_tokens=5, messages=[
            *messages, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "21"}])
        assert "<tool_response>21</tool_response>" in tokenizer.decode(model.prompts[-1])
        # Without tools in the request, the same text is plain content.
        plain = client.chat.completions.create(model="scripted", messages=messages, max_tokens=200).choices[0]
        assert plain.message.content == reply and not plain.message.tool_calls and plain.finish_reason == "stop"
