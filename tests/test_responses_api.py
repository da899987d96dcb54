"""`POST /v1/responses` (OpenAI Responses) on `tinkerless serve`, driven by the official `openai` client's Responses
API over real HTTP: the tiny model for sampling (greedy responses equal Chat Completions' token for token),
`previous_response_id` within the server's lifetime and per tenant, a scripted model for function calls (a random
model never writes one), and every error in OpenAI's shape.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from fastapi import FastAPI

from tinkerless.functions.hosting.agent_functions import bearer_token
from tinkerless.functions.openai_api.render import render_chat
from tinkerless.functions.responses_api import responses_router
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore
from tests.scripted_model import CALC, ScriptedModel, openai_client

pytestmark = pytest.mark.timeout(300)

KEY, BOB = "tml-alice-key", "tml-bob-key"
LONG = 1000
CALC_TOOL = {"type": "function", "strict": True, **CALC["function"]}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("responses-server")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice", BOB: "bob"}),
                     storage=str(storage), limits=ServingLimits(max_tokens=LONG, max_samples=4))
    with serve_in_thread(app) as url:
        yield url, app, worker


def base(app) -> str:
    return app.state.openai.base_model


@pytest.mark.parametrize("instructions, input", [
    (None, "Say something."),
    ("You are terse.", [{"role": "user", "content": "Say something, é 字."}]),
    ("Be kind.", [{"type": "message", "role": "developer", "content": "Mind the user."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say "},
                                                                  {"type": "input_text", "text": "hi"}]}]),
])
def test_a_greedy_response_is_the_chat_completion_token_for_token(server, instructions, input):
    url, app, worker = server
    client = openai_client(url, KEY)
    response = client.responses.create(model=base(app), input=input, instructions=instructions, temperature=0.0,
                                       max_output_tokens=12)
    chat = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(input, str):
        chat.append({"role": "user", "content": input})
    else:
        chat += [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                  else "".join(p["text"] for p in m["content"])} for m in input]
    completion = client.chat.completions.create(model=base(app), messages=chat, temperature=0.0, max_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == completion.choices[0].message.content
    assert response.usage.input_tokens == completion.usage.prompt_tokens == len(render_chat(worker.tokenizer, chat))
    assert response.usage.output_tokens == completion.usage.completion_tokens
    assert response.status == {"stop": "completed", "length": "incomplete"}[completion.choices[0].finish_reason]
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_the_conversation_for_its_caller_only(server):
    url, app, worker = server
    alice = openai_client(url, KEY)
    first = alice.responses.create(model=base(app), input="hi", temperature=0.0, max_output_tokens=6)
    second = alice.responses.create(model=base(app), input="again", previous_response_id=first.id,
                                    instructions="Be brief.", temperature=0.0, max_output_tokens=6)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "again"}]
    assert second.usage.input_tokens == len(render_chat(worker.tokenizer, [{"role": "system", "content": "Be brief."},
                                                                           *chat]))
    assert second.previous_response_id == first.id
    # A third continues the second, without the second's instructions (OpenAI's rule).
    third = alice.responses.create(model=base(app), input="once more", previous_response_id=second.id,
                                   temperature=0.0, max_output_tokens=6)
    chat += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "once more"}]
    assert third.usage.input_tokens == len(render_chat(worker.tokenizer, chat))
    # Another tenant's response reads as one that does not exist; so does one sent with store=false.
    with pytest.raises(openai.NotFoundError) as caught:
        openai_client(url, BOB).responses.create(model=base(app), input="x", previous_response_id=first.id)
    assert caught.value.body["code"] == "previous_response_not_found"
    unstored = alice.responses.create(model=base(app), input="hi", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.create(model=base(app), input="x", previous_response_id=unstored.id)


def test_streaming_events_give_the_plain_response(server):
    url, app, _ = server
    client = openai_client(url, KEY)
    plain = client.responses.create(model=base(app), input="Say something.", temperature=0.0, max_output_tokens=30)
    events = list(client.responses.create(model=base(app), input="Say something.", temperature=0.0,
                                          max_output_tokens=30, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{plain.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens and final.status == plain.status
    # The SDK's stream helper reads the same events (its final response needs `response.completed`: the scripted
    # test below); a streamed response is stored like any other.
    with client.responses.stream(model=base(app), input="Say something.", temperature=0.0,
                                 max_output_tokens=30) as stream:
        helped = [e for e in stream]
    assert "".join(e.delta for e in helped if e.type == "response.output_text.delta") == plain.output_text
    assert client.responses.create(model=base(app), input="more", previous_response_id=final.id,
                                   max_output_tokens=2).usage.input_tokens > plain.usage.input_tokens


def test_errors_are_openais_shape(server):
    url, app, _ = server
    client = openai_client(url, KEY)
    with pytest.raises(openai.AuthenticationError):
        openai_client(url, "wrong").responses.create(model=base(app), input="hi")
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="someone@latest", input="hi")
    assert caught.value.body["code"] == "model_not_found"
    cases = [
        ({"temperature": 3.0}, "temperature"),
        ({"max_output_tokens": LONG + 1}, "max_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "if": {}}}}},
         "text.format.schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "name": "has space"}]}, "tools[0].name"),
        ({"tools": [CALC_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"input": ""}, "input"),
    ]
    for override, param in cases:
        body = {"model": base(app), "input": "hi", "max_output_tokens": 4, **override}
        for stream in (False, True):  # before the first byte, a streamed request fails the same way
            with pytest.raises(openai.BadRequestError) as caught:
                client.responses.create(**body, stream=stream)
            assert caught.value.body["param"] == param, (override, caught.value.body)
    raw = httpx.post(f"{url}/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, content=b"[1]", timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["code"] == "invalid_json"
    assert client.responses.create(model=base(app), input="hi", max_output_tokens=2).output  # still serving


def test_an_abandoned_response_is_cancelled(server):
    url, app, worker = server
    backend = app.state.openai
    cancelled = backend.cancelled_choices
    slow = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        slow.responses.create(model=base(app), input="hi", temperature=0.0, max_output_tokens=LONG)
    deadline = time.monotonic() + 60
    while backend.cancelled_choices <= cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.cancelled_choices == cancelled + 1 and worker.engine.batcher.rows == 0


def test_function_calls_and_their_outputs_round_trip(server):
    tokenizer = server[2].tokenizer
    reply = 'Computing. <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>'
    model = ScriptedModel(tokenizer, [reply, "It is 21."])
    app = FastAPI()
    app.include_router(responses_router(model, caller=bearer_token))
    with serve_in_thread(app) as url:
        client = openai_client(url, "episode-1")
        first = client.responses.create(model="scripted", input="What is 3 * 7?", tools=[CALC_TOOL])
        assert [item.type for item in first.output] == ["message", "function_call"]
        call = first.output[1]
        assert first.output_text == "Computing." and first.status == "completed"
        assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "3 * 7"}
        events = list(client.responses.create(model="scripted", input="What is 3 * 7?", tools=[CALC_TOOL],
                                              stream=True))
        final = events[-1].response
        assert [item.type for item in final.output] == ["message", "function_call"]
        assert (final.output[1].name, json.loads(final.output[1].arguments)) == ("calculator", {"expression": "3 * 7"})
        assert "response.function_call_arguments.done" in [e.type for e in events]
        with client.responses.stream(model="scripted", input="What is 3 * 7?", tools=[CALC_TOOL]) as stream:
            helper = stream.get_final_response()
        assert helper.output_text == "Computing." and helper.output[1].arguments == call.arguments

        # The items go back with the output: rendered as Chat Completions renders the call and its result.
        model.turn = 1
        items = [{"role": "user", "content": "What is 3 * 7?"}, *[i.model_dump(exclude_none=True) for i in first.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "21"}]
        second = client.responses.create(model="scripted", input=items, tools=[CALC_TOOL])
        assert second.output_text == "It is 21."
        chat = [{"role": "user", "content": "What is 3 * 7?"},
                {"role": "assistant", "content": "Computing.", "tool_calls": [
                    {"id": call.call_id, "type": "function", "function": {"name": "calculator",
                                                                          "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "21"}]
        assert model.prompts[-1] == render_chat(tokenizer, chat, [CALC])
        # The same through previous_response_id: only the output goes in the new input.
        again = client.responses.create(model="scripted", previous_response_id=first.id, tools=[CALC_TOOL], input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "21"}])
        assert again.output_text == "It is 21." and model.prompts[-1] == render_chat(tokenizer, chat, [CALC])
        # tool_choice none: nothing rendered, the call is text.
        model.turn = 0
        plain = client.responses.create(model="scripted", input="What is 3 * 7?", tools=[CALC_TOOL], tool_choice="none")
        assert [i.type for i in plain.output] == ["message"] and plain.output_text == reply
