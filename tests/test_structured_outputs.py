"""Structured outputs, enforced by constrained decoding (llguidance token masks in the sampler), on the tiny random
model: whatever the random weights prefer, every reply parses and validates against its schema, on every API
(Chat Completions' `response_format`, Responses' `text.format`, Messages' `output_config.format`), through
LangChain's `with_structured_output` and an Agents SDK `output_type`, and in a training rollout."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
import torch

from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore
from tests.scripted_model import openai_client

pytestmark = pytest.mark.timeout(300)

KEY = "tml-alice-key"
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "boolean"}, "kind": {"enum": ["cat", "dog", "fish"]}},
     "required": ["answer", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {"x": {"enum": [0, 1, 2]}},
                                           "required": ["x"], "additionalProperties": False}},
     "properties": {"at": {"$ref": "#/$defs/point"}, "note": {"anyOf": [{"type": "null"}, {"const": "ok"}]}},
     "required": ["at", "note"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("structured-server")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice"}), storage=str(storage),
                     limits=ServingLimits(max_tokens=256, max_samples=4))
    with serve_in_thread(app) as url:
        yield url, app, worker


def base(app) -> str:
    return app.state.openai.base_model


ASK = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_choice_of_every_api_parses_against_its_schema(server, schema):
    url, app, _ = server
    client = openai_client(url, KEY)
    for seed in (0,):  # (n=3 rows of one batch, each from its own generator)
        chat = client.chat.completions.create(
            model=base(app), messages=ASK, max_tokens=200, n=3, seed=seed, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}})
        for choice in chat.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=base(app), messages=ASK, max_tokens=200, seed=5, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}))
    jsonschema.validate(json.loads(streamed), schema)
    response = client.responses.create(model=base(app), input="Describe a pet as JSON.", max_output_tokens=200,
                                       text={"format": {"type": "json_schema", "name": "pet", "schema": schema}})
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)
    message = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model=base(app), max_tokens=200, messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_constrained_rows_keep_their_grammar_where_the_engine_decodes_several_steps_per_host_read(server):
    """A GPU decodes `decode_steps` tokens per host read (sampling/device_decode.py), but a grammar's mask needs the
    host after every token: a block holding a constrained row stays on the one-step loop, so its rows still parse,
    and unconstrained requests beside them decode as before."""
    url, app, worker = server
    client = openai_client(url, KEY)
    batcher = worker.engine.batcher
    saved, batcher.decode_steps = batcher.decode_steps, 4
    try:
        chat = client.chat.completions.create(
            model=base(app), messages=ASK, max_tokens=200, n=3, seed=11, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMAS[0]}})
        plain = client.chat.completions.create(model=base(app), messages=ASK, max_tokens=12, n=2, seed=11)
    finally:
        batcher.decode_steps = saved
    for choice in chat.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[0])
    again = client.chat.completions.create(model=base(app), messages=ASK, max_tokens=12, n=2, seed=11)
    assert [c.message.content for c in plain.choices] == [c.message.content for c in again.choices]


def test_json_object_and_the_log_probs_of_constrained_tokens(server):
    url, app, worker = server
    client = openai_client(url, KEY)
    reply = client.chat.completions.create(model=base(app), messages=ASK, max_tokens=200, seed=3, logprobs=True,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    # The first token is forced ("{" is the only one allowed): drawn from a one-token distribution, log-prob 0.
    tokens = reply.choices[0].logprobs.content
    assert tokens[0].token == "{" and tokens[0].logprob == 0.0
    # Every constrained token's log-prob is of the masked distribution: at least the unmasked model's.
    prompt = worker.chat.prompt_tokens(ASK)
    ids = [worker.tokenizer.convert_tokens_to_ids(t.token) if len(t.token) > 1 else
           worker.tokenizer.encode(t.token, add_special_tokens=False)[0] for t in tokens]
    with torch.no_grad():
        logits = worker.model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    unmasked = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
    assert all(t.logprob >= u - 1e-4 for t, u in zip(tokens, unmasked.tolist()))
    assert any(t.logprob > u + 1e-3 for t, u in zip(tokens, unmasked.tolist()))  # the mask did renormalize


def test_a_schema_the_library_cannot_compile_is_a_400_naming_the_construct(server):
    url, app, _ = server
    client = openai_client(url, KEY)
    bad = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=base(app), messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": bad}})
    assert caught.value.body["param"] == "response_format.json_schema.schema" and '"if"' in caught.value.body["message"]
    assert caught.value.body["code"] == "unsupported_schema"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=base(app), input="x", text={"format": {"type": "json_schema", "name": "x",
                                                                             "schema": bad}})
    assert caught.value.body["param"] == "text.format.schema" and '"if"' in caught.value.body["message"]
    for form, param in (({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema"),
                        ({"type": "yaml"}, "response_format")):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=base(app), messages=ASK, max_tokens=8, response_format=form)
        assert caught.value.body["param"] == param


def test_langchain_with_structured_output_always_parses(server):
    from langchain_openai import ChatOpenAI

    url, app, _ = server
    schema = {"title": "Pet", "description": "A pet.", **SCHEMAS[0]}
    chat = ChatOpenAI(model=base(app), base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60, max_tokens=200)
    structured = chat.with_structured_output(schema)  # LangChain's default method: json_schema
    for question in ("A pet?", "Another pet?", "A third?"):
        result = structured.invoke(question)
        jsonschema.validate(result, SCHEMAS[0])


def test_an_agents_sdk_output_type_always_parses(server):
    import asyncio
    from typing import Literal

    from agents import Agent, Runner, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from pydantic import BaseModel

    set_tracing_disabled(True)
    url, app, _ = server

    class Pet(BaseModel):
        answer: bool
        kind: Literal["cat", "dog", "fish"]

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        agent = Agent(name="pets", instructions="Answer as JSON.", output_type=Pet,
                      model=OpenAIResponsesModel(model=base(app), openai_client=client))
        return [(await Runner.run(agent, f"Pet number {i}?")).final_output for i in range(3)]

    assert all(isinstance(pet, Pet) for pet in asyncio.run(run()))


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time.", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}


def test_a_required_or_named_tool_call_is_enforced_on_every_api(server):
    url, app, _ = server
    client = openai_client(url, KEY)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for choice, allowed in (("required", {"weather", "clock"}),
                            ({"type": "function", "function": {"name": "clock"}}, {"clock"})):
        reply = client.chat.completions.create(model=base(app), messages=ASK, max_tokens=120, n=3, seed=1,
                                               tools=[WEATHER, CLOCK], tool_choice=choice)
        for c in reply.choices:
            assert c.finish_reason == "tool_calls", c.message.content
            (call,) = c.message.tool_calls
            assert call.function.name in allowed
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    tools = [{"type": "function", "strict": True, **t["function"]} for t in (WEATHER, CLOCK)]
    response = client.responses.create(model=base(app), input="Weather?", tools=tools, tool_choice="required",
                                       max_output_tokens=120)
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    message = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0).messages.create(
        model=base(app), max_tokens=120, messages=ASK, tool_choice={"type": "tool", "name": "weather"},
        tools=[{"name": t["function"]["name"], "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"]} for t in (WEATHER, CLOCK)])
    assert message.stop_reason == "tool_use" and message.content[-1].name == "weather"
    jsonschema.validate(message.content[-1].input, schemas["weather"])
