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


NOTE = {"type": "function", "function": {"name": "note", "description": "Keep a note.", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}, "stars": {"type": "integer",
                                                                                           "minimum": 1, "maximum": 5}},
    "required": ["text", "stars"], "additionalProperties": False}}}
# What a policy might try to write: tool calls whose arguments break their schema (or name no tool)
ATTEMPTS = ['Sure. <tool_call>{"name": "weather", "arguments": {"city": "Rome", "days": 9}}</tool_call>',
            '<tool_call>{"name": "clock", "arguments": {"utc": "yes"}}</tool_call>',
            'a <tool_call>{"name": "note", "arguments": {"text": "far too long a note", "stars": 0}}</tool_call>',
            '<tool_call>{"name": "calc", "arguments": {}}</tool_call> and <tool_call>{"name": "clock"}</tool_call>',
            'no call at all, <tool_call is not a call']


def _steered(worker, attempt: str, grammar, seed: int) -> str:
    """The sampler's masked draw (`constraints.mask_logits`) from random logits steered hard toward `attempt`'s
    next byte while the draws still follow it: what a policy that wants to write `attempt` gets under `grammar`."""
    from tinkerless.functions.openai_api.render import chat_format
    from tinkerless.functions.sampling.constraints import mask_logits

    tokenizer = worker.tokenizer
    wanted, stops = tokenizer.encode(attempt, add_special_tokens=False), chat_format(tokenizer).eos_token_ids
    constraint = grammar.constraint() if grammar is not None else None
    generator, drawn = torch.Generator().manual_seed(seed), []
    for _ in range(160):
        logits = torch.randn(1, len(tokenizer), generator=generator)
        following = drawn == wanted[:len(drawn)]
        logits[0, wanted[len(drawn)] if following and len(drawn) < len(wanted) else stops[0]] += 25.0
        token = int(torch.multinomial(torch.softmax(mask_logits(logits, [constraint]), -1), 1, generator=generator))
        if token in stops:
            break
        drawn.append(token)
        if constraint is not None:
            constraint.advance(token)
    return tokenizer.decode(drawn)


def test_strict_tools_under_auto_hold_every_call_a_policy_opens_to_its_schema(server):
    """The grammar of tool_choice auto with strict tools, in the sampler's own mask: free text stays free, and every
    call opened follows its tool's schema (or names a tool); unmasked, the same steering writes the broken calls."""
    from tinkerless.functions.openai_api.render import chat_format, parse_tool_calls, strict_tools_grammar
    from tinkerless.functions.sampling.constraints import Grammar

    _, _, worker = server
    tokenizer, tools = worker.tokenizer, [WEATHER, CLOCK, NOTE]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    grammar = Grammar(tokenizer, None, chat_format(tokenizer).eos_token_ids, len(tokenizer),
                      lark=strict_tools_grammar(tools, set(schemas)))
    opened = 0
    for i, attempt in enumerate(ATTEMPTS):
        free = _steered(worker, attempt, None, i)
        assert free == attempt and all(  # the steering writes the attempt when nothing masks it
            not c["function"]["name"] in schemas or not _valid(json.loads(c["function"]["arguments"]),
                                                               schemas[c["function"]["name"]])
            for c in parse_tool_calls(free)[1])
        for seed in range(4):
            text = _steered(worker, attempt, grammar, 100 * i + seed)
            content, calls = parse_tool_calls(text)
            opened += text.count("<tool_call>")
            assert text.count("<tool_call>") == len(calls) or not text.endswith("</tool_call>"), text
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
            if "<tool_call>" not in attempt:
                assert text == attempt  # text without a call is not masked at all
    assert opened >= 12


def _valid(value, schema) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_strict_tools_under_auto_are_enforced_on_every_api(server):
    """On every API, a strict tool under tool_choice auto compiles its grammar (a schema the library cannot compile
    is a 400 naming the construct, as only an enforced schema would be), replies follow it, and the same tool without
    strict is not constrained (accepted whatever its schema)."""
    url, app, _ = server
    client = openai_client(url, KEY)
    claude = anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0)
    broken = {"type": "object", "if": {}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK, NOTE)}

    def ask(api: str, tools: list[dict], strict: bool):
        if api == "chat":
            reply = client.chat.completions.create(model=base(app), messages=ASK, max_tokens=40, n=2, seed=3, tools=[
                {"type": "function", "function": {**t["function"], "strict": strict}} for t in tools])
            return [(c.function.name, json.loads(c.function.arguments)) for ch in reply.choices
                    for c in ch.message.tool_calls or []]
        if api == "responses":
            reply = client.responses.create(model=base(app), input="Weather?", max_output_tokens=40, tools=[
                {"type": "function", "strict": strict, **t["function"]} for t in tools])
            assert all(t.strict == strict for t in reply.tools)
            return [(i.name, json.loads(i.arguments)) for i in reply.output if i.type == "function_call"]
        reply = claude.messages.create(model=base(app), max_tokens=40, messages=ASK, tools=[
            {"name": t["function"]["name"], "description": t["function"]["description"], "strict": strict,
             "input_schema": t["function"]["parameters"]} for t in tools])
        return [(b.name, b.input) for b in reply.content if b.type == "tool_use"]

    bad_tool = {"type": "function", "function": {"name": "bad", "description": "", "parameters": broken}}
    for api, refused in (("chat", openai.BadRequestError), ("responses", openai.BadRequestError),
                         ("messages", anthropic.BadRequestError)):
        for name, arguments in ask(api, [WEATHER, CLOCK, NOTE], True):
            jsonschema.validate(arguments, schemas[name])
        with pytest.raises(refused, match="Unimplemented keys: \\[\"if\"\\]"):
            ask(api, [WEATHER, bad_tool], True)
        ask(api, [WEATHER, bad_tool], False)  # not strict: rendered, not compiled, not enforced
