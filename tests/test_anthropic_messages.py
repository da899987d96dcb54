"""`POST /v1/messages` (Anthropic Messages) on `tinkerless serve`, driven by the official `anthropic` SDK over real
HTTP: the tiny model for sampling (greedy replies equal Chat Completions' token for token), a scripted model for
tool use (a random model never writes a tool call), and every error in Anthropic's shape.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest

import tinkerless
from fastapi import FastAPI

from tinkerless.functions.anthropic_api import messages_router
from tinkerless.functions.hosting.agent_functions import bearer_token
from tinkerless.functions.openai_api.render import render_chat
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore
from tests.scripted_model import CALC, ScriptedModel, openai_client

pytestmark = pytest.mark.timeout(300)

KEY = "tml-alice-key"
GREEDY = {"temperature": 0.0}  # (this SDK sends sampling settings as extra body fields: newer Claude models take none)
LONG = 1000


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("messages-server")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice", "tml-bob-key": "bob"}), storage=str(storage),
                     limits=ServingLimits(max_tokens=LONG, max_samples=4))
    with serve_in_thread(app) as url:
        yield url, app, worker


def claude(url: str, key: str = KEY, **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=options.pop("timeout", 120), **options)


def base(app) -> str:
    return app.state.openai.base_model


@pytest.mark.parametrize("system, content", [
    (None, "Say something."),
    ("You are terse.", [{"type": "text", "text": "Say "}, {"type": "text", "text": "something, é 字."}]),
    ([{"type": "text", "text": "Be kind."}], "hi"),
])
def test_a_greedy_message_is_the_chat_completion_token_for_token(server, system, content):
    url, app, worker = server
    extra = {} if system is None else {"system": system}
    message = claude(url).messages.create(model=base(app), max_tokens=12, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": content}], **extra)
    chat_messages = ([] if system is None else [{"role": "system", "content": system if isinstance(system, str)
                                                 else system[0]["text"]}])
    text = content if isinstance(content, str) else "".join(p["text"] for p in content)
    chat_messages.append({"role": "user", "content": text})
    chat = openai_client(url, KEY).chat.completions.create(model=base(app), messages=chat_messages, max_tokens=12,
                                                           extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens == len(render_chat(worker.tokenizer, chat_messages))
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]


def test_stop_sequences_top_k_and_streaming_agree_with_the_plain_reply(server):
    url, app, _ = server
    hi = [{"role": "user", "content": "Say something."}]
    whole = claude(url).messages.create(model=base(app), max_tokens=40, extra_body=GREEDY, messages=hi)
    text = whole.content[0].text
    assert len(text) > 8, text
    for stop in (text[3:5], text[-3:], text[0]):
        cut = claude(url).messages.create(model=base(app), max_tokens=40, extra_body=GREEDY, messages=hi,
                                          stop_sequences=["\x00never", stop])
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.index(stop)]
        with claude(url).messages.stream(model=base(app), max_tokens=40, extra_body=GREEDY, messages=hi,
                                         stop_sequences=[stop]) as stream:
            deltas = list(stream.text_stream)
            streamed = stream.get_final_message()
        assert "".join(deltas) == cut.content[0].text == streamed.content[0].text
        assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
        assert streamed.usage.output_tokens == cut.usage.output_tokens
    # top_k=1 is greedy whatever the temperature.
    assert claude(url).messages.create(model=base(app), max_tokens=40, extra_body={"temperature": 1.0, "top_k": 1},
                                       messages=hi).content[0].text == text


def test_the_stream_is_anthropics_event_sequence(server):
    url, app, _ = server
    response = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        "model": base(app), "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [(e.split("\n")[0].removeprefix("event: "), json.loads(e.split("\n")[1].removeprefix("data: ")))
              for e in response.text.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert set(names[2:-3]) <= {"content_block_delta"} and names[-3] == "content_block_stop"
    assert events[0][1]["message"]["usage"]["input_tokens"] > 0
    assert events[-2][1]["usage"]["output_tokens"] == 6 and events[-2][1]["delta"]["stop_reason"] in ("max_tokens", "end_turn")


def test_errors_are_anthropics_shape_with_the_right_class(server):
    url, app, _ = server
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude(url, key="wrong").messages.create(model=base(app), max_tokens=4, messages=hi)
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude(url).messages.create(model="someone-else@latest", max_tokens=4, messages=hi)
    assert caught.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                            "message": caught.value.body["error"]["message"]}}
    cases = [
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "if": {}}}}},
         "output_config.format.schema"),
        ({"output_config": {"format": {"type": "yaml"}}}, "output_config.format"),
        ({"max_tokens": LONG + 1}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type":
                                                                                  "image/png", "data": "AA=="}}]}]},
         "messages"),  # a text-only model: images need a vision-language model (tests/test_api_images.py)
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [*hi, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "calculator",
                                                               "input": {}}]}]}, "messages.1"),
        ({"messages": [*hi, {"role": "assistant", "content": "{"}], "output_config": {"format": {
            "type": "json_schema", "schema": {"type": "object"}}}}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url":
                                                                                  "http://127.0.0.1:1/x.png"}}]}]},
         "messages.0.content.0.source"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"tools": [{"name": "has space", "input_schema": {"type": "object"}}]}, "tools.0.name"),
        ({"tools": [CALC_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"stop_sequences": [""]}, "stop_sequences"),
    ]
    for override, param in cases:
        body = {"model": base(app), "max_tokens": 4, "messages": hi, **override}
        for stream in (False, True):  # before the first byte, a streamed request fails the same way
            with pytest.raises(anthropic.BadRequestError) as caught:
                claude(url).messages.create(**body, stream=stream)
            error = caught.value.body["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith(param), (override, error)
    raw = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, content=b"{not json", timeout=30)
    assert raw.status_code == 400 and raw.json()["type"] == "error"
    assert raw.json()["error"]["type"] == "invalid_request_error"
    # The server is still serving; a key in x-api-key (Anthropic's header) is a key as a bearer token is.
    assert claude(url).messages.create(model=base(app), max_tokens=2, messages=hi).content
    keyed = httpx.post(f"{url}/v1/messages", headers={"x-api-key": KEY}, timeout=30,
                       json={"model": base(app), "max_tokens": 2, "messages": hi})
    assert keyed.status_code == 200 and keyed.json()["usage"]["output_tokens"] == 2


@pytest.mark.parametrize("prefill", ["Sure", "The answer is", " {\"a\": ", "é字\n-"])
def test_a_prefill_is_continued_from_the_template_rendering_left_open(server, prefill):
    """A last assistant turn is rendered as the template writes it, without its end of turn, and the reply is the
    greedy continuation of exactly those tokens (the raw /v1/completions of the same ids); only the new text comes
    back, as Anthropic's does."""
    url, app, worker = server
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]
    message = claude(url).messages.create(model=base(app), max_tokens=8, extra_body=GREEDY, system="Be brief.",
                                          messages=[chat[1], {"role": "assistant", "content": prefill}])
    prompt = render_chat(worker.tokenizer, [*chat, {"role": "assistant", "content": prefill}], continue_final=True)
    closed = worker.tokenizer.apply_chat_template([*chat, {"role": "assistant", "content": prefill}], tokenize=False)
    assert closed.startswith(worker.tokenizer.decode(prompt)) and worker.tokenizer.decode(prompt).endswith(prefill)
    raw = openai_client(url, KEY).completions.create(model=base(app), prompt=prompt, max_tokens=8, temperature=0)
    assert message.usage.input_tokens == len(prompt)
    assert message.content[0].text == raw.choices[0].text.split("<|im_end|>")[0]


def test_an_abandoned_message_is_cancelled(server):
    url, app, worker = server
    backend = app.state.openai
    cancelled = backend.cancelled_choices
    with pytest.raises(anthropic.APITimeoutError):
        claude(url, timeout=0.5).messages.create(model=base(app), max_tokens=LONG, extra_body=GREEDY,
                                                 messages=[{"role": "user", "content": "hi"}])
    deadline = time.monotonic() + 60
    while backend.cancelled_choices <= cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.cancelled_choices == cancelled + 1 and worker.engine.batcher.rows == 0


CALC_TOOL = {"name": CALC["function"]["name"], "description": CALC["function"]["description"],
             "input_schema": CALC["function"]["parameters"]}


def test_tool_use_and_tool_results_round_trip(server):
    tokenizer_of_tiny = server[2].tokenizer
    reply = 'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>'
    model = ScriptedModel(tokenizer_of_tiny, [reply, "It is 21."])
    app = FastAPI()
    app.include_router(messages_router(model, caller=bearer_token))
    with serve_in_thread(app) as url:
        client = claude(url, key="episode-1")
        ask = [{"role": "user", "content": "What is 3 * 7?"}]
        first = client.messages.create(model="scripted", max_tokens=200, tools=[CALC_TOOL], messages=ask)
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
        assert first.content[0].text == "Let me compute."
        use = first.content[1]
        assert use.name == "calculator" and use.input == {"expression": "3 * 7"} and use.id.startswith("toolu_")
        assert first.usage.output_tokens == len(model.replies[0])
        with client.messages.stream(model="scripted", max_tokens=200, tools=[CALC_TOOL], messages=ask) as stream:
            streamed = stream.get_final_message()
        assert streamed.stop_reason == "tool_use" and streamed.content[0].text == "Let me compute."
        assert (streamed.content[1].name, streamed.content[1].input) == ("calculator", {"expression": "3 * 7"})

        # The tool_use block and its tool_result go back: rendered as Chat Completions renders a call and its result.
        follow = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": [{"type": "text", "text": "21"}]}]}]
        model.turn = 1
        second = client.messages.create(model="scripted", max_tokens=200, tools=[CALC_TOOL], messages=follow)
        assert second.stop_reason == "end_turn" and second.content[0].text == "It is 21."
        chat = [{"role": "user", "content": "What is 3 * 7?"},
                {"role": "assistant", "content": "Let me compute.", "tool_calls": [
                    {"id": use.id, "type": "function",
                     "function": {"name": "calculator", "arguments": json.dumps({"expression": "3 * 7"})}}]},
                {"role": "tool", "tool_call_id": use.id, "content": "21"}]
        assert model.prompts[-1] == render_chat(tokenizer_of_tiny, chat, [CALC])
        assert "<tool_response>21</tool_response>" in tokenizer_of_tiny.decode(model.prompts[-1])

        # tool_choice none: no tools rendered, the same text is plain content.
        model.turn = 0
        plain = client.messages.create(model="scripted", max_tokens=200, tools=[CALC_TOOL], messages=ask,
                                       tool_choice={"type": "none"})
        assert plain.stop_reason == "end_turn" and [b.type for b in plain.content] == ["text"]
        assert plain.content[0].text == reply and model.prompts[-1] == render_chat(tokenizer_of_tiny, ask)
        # A reply cut by max_tokens inside the call is text, stopped at max_tokens.
        cut = client.messages.create(model="scripted", max_tokens=3, tools=[CALC_TOOL], messages=ask)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_a_live_policy_answers_on_messages_and_responses_for_its_tenant_only(server):
    from tests.scripted_model import openai_client
    from tinkerless.server.tenancy import tenant_prefix
    from tinkerless.wire.messages import CreatePolicyRequest, LoraConfig

    url, app, worker = server
    worker.create_policy(CreatePolicyRequest(tenant_prefix("alice") + "mine", LoraConfig(rank=4, seed=3)))
    hi = [{"role": "user", "content": "hi"}]
    message = claude(url).messages.create(model="mine", max_tokens=3, messages=hi, extra_body=GREEDY)
    response = openai_client(url, KEY).responses.create(model="mine", input="hi", max_output_tokens=3, temperature=0.0)
    chat = openai_client(url, KEY).chat.completions.create(model="mine", messages=hi, max_tokens=3, temperature=0.0)
    assert message.content[0].text == response.output_text == chat.choices[0].message.content
    with pytest.raises(anthropic.NotFoundError):  # bob's "mine" is a name like any other that does not exist
        claude(url, key="tml-bob-key").messages.create(model="mine", max_tokens=3, messages=hi)


@tinkerless.agent
async def claude_agent(client, task):
    claude = tinkerless.anthropic_client(client)
    reply = await claude.messages.create(model="policy", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    return float(reply.usage.output_tokens)


def test_tinkerless_eval_sends_an_anthropic_agents_policy_calls_to_the_evaluated_model(server):
    from tinkerless.sdk.evaluation.agent_eval import evaluate_agent

    url, app, _ = server
    report = evaluate_agent(claude_agent, [{"q": 1}], endpoint=f"{url}/v1", model=base(app), api_key=KEY, episodes=2)
    assert [e.error for e in report.episodes] == [None, None]
    assert all(1 <= e.reward <= 3 and e.calls[0]["request"]["model"] == base(app) for e in report.episodes)
