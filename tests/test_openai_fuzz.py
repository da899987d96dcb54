"""Property-based fuzzing of the OpenAI routes of `tinkerless serve` (auth on): never a 5xx.

Bodies are drawn around the real request shapes (every field either plausible or junk of any JSON
type, plus unknown fields, raw non-JSON bytes and deep nesting). Every answer is a 2xx (JSON, or SSE
ending in `data: [DONE]`) or a 4xx with the OpenAI error body; the server still serves afterwards.
The server's limits are small so that whatever is accepted samples only a few tokens.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore

EXAMPLES = int(os.environ.get("TINKERLESS_FUZZ_EXAMPLES", "300"))
AUTH = {"Authorization": "Bearer fuzz-key"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    from tinkerless.functions.worker import Worker

    storage = tmp_path_factory.mktemp("openai-fuzz")
    app = create_app(Worker(tiny_model), keys=KeyStore(ObjectStore(str(storage)), extra_keys={"fuzz-key": "fuzzer"}),
                     storage=str(storage), limits=ServingLimits(max_tokens=6, max_samples=4, max_prompt_tokens=512))
    with serve_in_thread(app) as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            yield http, app.state.openai.base_model


junk = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value (so that many bodies get as far as sampling), sometimes junk of any type."""
    # (a middle value picks junk: hypothesis draws the ends of a range far more often than uniformly)
    return st.integers(0, 9).flatmap(lambda pick: junk if pick == 6 else plausible)


@st.composite
def spoiled(draw, bodies: st.SearchStrategy) -> dict:
    """A body, and in half the cases one of its fields replaced by junk: each field's validation is reached."""
    body = draw(bodies)
    if body and draw(st.integers(0, 3)) == 2:
        body[draw(st.sampled_from(sorted(body)))] = draw(junk)
    return body


def models(base: str) -> st.SearchStrategy:
    return st.integers(0, 9).flatmap(lambda pick: st.just(base) if pick not in (5, 6) else st.one_of(st.sampled_from([base, "smollm2", "nope", "run@latest", "run@1", "../x@1", "a/b@2", "a@" + "9" * 30,
                                  "@", "x@latest\n", "default", base + "@latest", "tinker://", "tinker://a/sampler_weights/b", "tinker://../../weights/x", "tinker://a/b/c/d"]), st.text(max_size=20)))


text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]), "text": junk})
tool_call = st.fixed_dictionaries({"id": junk, "type": field(st.just("function")), "function": field(
    st.fixed_dictionaries({"name": field(st.text(max_size=8)), "arguments": field(st.just('{"x": 1}') | st.text(max_size=8))}))})
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]))},
    optional={"content": field(st.text(max_size=40) | st.lists(text_part, max_size=2)),
              "tool_calls": field(st.lists(tool_call, max_size=2)), "tool_call_id": field(st.text(max_size=5)),
              "name": field(st.text(max_size=5))},
)
tool = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(st.fixed_dictionaries(
    {"name": field(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))},
    optional={"description": junk, "parameters": field(st.just({"type": "object", "properties": {"x": {"type": "string"}}}))}))})
sampling = {
    "n": field(st.integers(1, 5)), "temperature": field(st.floats(0, 2.5)), "top_p": field(st.floats(0, 1.2)),
    "max_tokens": field(st.integers(0, 8)), "stop": field(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5)),
    "seed": field(st.integers(-(2**64), 2**64)), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": field(st.booleans())})),
    "presence_penalty": field(st.just(0.0)), "logit_bias": field(st.just({})), "user": junk, "unknown_field": junk,
}


def chat_bodies(base: str):
    return spoiled(st.fixed_dictionaries({"model": models(base), "messages": field(st.lists(message, min_size=1, max_size=3))}, optional={
        "max_completion_tokens": field(st.integers(0, 8)), "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 25)), "tools": field(st.lists(tool, max_size=2)),
        "tool_choice": field(st.sampled_from(["auto", "none", "required"])), "response_format": field(st.just({"type": "text"})), **sampling}))


def completion_bodies(base: str):
    prompt = st.text(min_size=1, max_size=30) | st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=5) \
        | st.lists(st.integers(-5, 300), max_size=20) | st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=3)
    return spoiled(st.fixed_dictionaries({"model": models(base), "prompt": field(prompt)}, optional={
        "logprobs": field(st.integers(0, 25)), "echo": field(st.just(False)), "suffix": field(st.none()),
        "best_of": field(st.none()), **sampling}))


def check(response: httpx.Response, sent) -> None:
    where = f"{response.request.method} {response.request.url.path} {str(sent)[:300]}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:400]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], where
        assert error["type"] and error["code"], where  # a client can branch on both, whatever went wrong
        assert "Value error, " not in error["message"], where  # the caller's terms, not pydantic's
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), where
    elif response.request.method == "GET":
        assert response.json()["object"] in ("list", "model"), where
    else:
        assert response.json()["choices"], where


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_no_request_body_gets_a_5xx(server):
    http, base = server

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.tuples(st.just("/v1/chat/completions"), chat_bodies(base)),
        st.tuples(st.just("/v1/completions"), completion_bodies(base)),
        st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), junk),
    ))
    def one(case):
        path, body = case
        check(http.post(path, content=json.dumps(body).encode(), headers=AUTH), body)

    one()
    for raw in (b"", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"model": 1e999}', b"{" * 50, b"null"):
        for path in ("/v1/chat/completions", "/v1/completions"):
            check(http.post(path, content=raw, headers=AUTH), raw[:40])
    for path in ("/v1/models", "/v1/models/x", "/v1/models/" + "%2e%2e/" * 5, "/v1/models/a@1"):
        check(http.get(path, headers=AUTH), path)
    # Found by this fuzz: a temperature near zero overflowed the logits (NaN probabilities) -> 500; now greedy.
    for temperature in (1e-300, 5e-324, 1e-5):
        tiny = {"model": base, "prompt": "ab", "max_tokens": 3, "temperature": temperature, "logprobs": 2}
        reply = http.post("/v1/completions", headers=AUTH, json=tiny)
        check(reply, tiny)
        assert reply.status_code == 200
    answer = http.post("/v1/chat/completions", headers=AUTH,
                       json={"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["role"] == "assistant"


block = st.one_of(
    st.fixed_dictionaries({"type": field(st.just("text")), "text": field(st.text(max_size=20))}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": field(st.text(max_size=5)), "name": field(st.text(max_size=5)),
                           "input": field(st.just({"x": 1}))}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": field(st.text(max_size=5)),
                           "content": field(st.text(max_size=10) | st.lists(junk, max_size=2))}),
    st.fixed_dictionaries({"type": st.sampled_from(["image", "thinking", "document", ""])}, optional={"source": junk}),
)
anthropic_message = st.fixed_dictionaries({"role": field(st.sampled_from(["user", "user", "assistant", "system"])),
                                           "content": field(st.text(max_size=30) | st.lists(block, max_size=3))})
anthropic_tool = st.fixed_dictionaries({"name": field(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))}, optional={
    "type": field(st.sampled_from(["custom", "bash_20250124"])), "description": junk,
    "input_schema": field(st.just({"type": "object", "properties": {"x": {"type": "string"}}}))})


def messages_bodies(base: str):
    return spoiled(st.fixed_dictionaries({"model": models(base), "max_tokens": field(st.integers(0, 8)),
                                          "messages": field(st.lists(anthropic_message, min_size=1, max_size=3))}, optional={
        "system": field(st.text(max_size=20) | st.lists(block, max_size=2)),
        "stop_sequences": field(st.lists(st.text(max_size=3), max_size=3)), "temperature": field(st.floats(-0.5, 1.5)),
        "top_p": field(st.floats(0, 1.2)), "top_k": field(st.integers(-2, 2**40)), "stream": field(st.booleans()),
        "tools": field(st.lists(anthropic_tool, max_size=2)),
        "tool_choice": field(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                              {"type": "tool", "name": "x"}, {"type": "bogus"}])),
        "thinking": field(st.sampled_from([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 5}])),
        "metadata": junk, "unknown_field": junk}))


item = st.one_of(
    st.fixed_dictionaries({"role": field(st.sampled_from(["user", "assistant", "system", "developer", "tool"]))},
                          optional={"type": field(st.just("message")), "content": field(st.text(max_size=30) | st.lists(
                              st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                                     "text": junk}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": field(st.text(max_size=5)),
                           "name": field(st.text(max_size=5)), "arguments": field(st.just('{"x": 1}') | st.text(max_size=6))}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": field(st.text(max_size=5)),
                           "output": field(st.text(max_size=10))}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])}),
)
responses_tool = st.fixed_dictionaries({"type": field(st.sampled_from(["function", "function", "web_search"])),
                                        "name": field(st.from_regex(r"[a-z_]{1,10}", fullmatch=True))}, optional={
    "parameters": field(st.just({"type": "object", "properties": {"x": {"type": "string"}}})), "strict": junk})


def responses_bodies(base: str):
    return spoiled(st.fixed_dictionaries({"model": models(base), "input": field(st.text(max_size=30) | st.lists(item, max_size=3))},
                                         optional={
        "instructions": field(st.text(max_size=20)), "max_output_tokens": field(st.integers(0, 8)),
        "temperature": field(st.floats(0, 2.5)), "top_p": field(st.floats(0, 1.2)), "stream": field(st.booleans()),
        "store": field(st.booleans()), "previous_response_id": field(st.sampled_from(["resp_x", "", "resp_" + "0" * 24])),
        "tools": field(st.lists(responses_tool, max_size=2)), "tool_choice": field(st.sampled_from(["auto", "none", "required"])),
        "text": field(st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}])),
        "reasoning": junk, "metadata": junk, "unknown_field": junk}))


def check_other(response: httpx.Response, sent) -> None:
    """`check` for /v1/messages (Anthropic's error shape and events) and /v1/responses (OpenAI's error shape)."""
    where = f"{response.request.url.path} {str(sent)[:300]}"
    anthropic = response.request.url.path == "/v1/messages"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:400]}"
    if response.status_code >= 400:
        body = response.json()
        if anthropic:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], where
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"], where
        assert "Value error, " not in str(body), where
    elif response.headers["content-type"].startswith("text/event-stream"):
        last = response.text.strip().split("\n\n")[-1]
        assert last.startswith("event: message_stop" if anthropic else "event: response."), where
    else:
        assert response.json()["type" if anthropic else "object"] in ("message", "response"), where


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_no_messages_or_responses_body_gets_a_5xx(server):
    http, base = server

    @settings(max_examples=max(1, EXAMPLES // 2), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(
        st.tuples(st.just("/v1/messages"), messages_bodies(base)),
        st.tuples(st.just("/v1/responses"), responses_bodies(base)),
        st.tuples(st.sampled_from(["/v1/messages", "/v1/responses"]), junk),
    ))
    def one(case):
        path, body = case
        check_other(http.post(path, content=json.dumps(body).encode(), headers=AUTH), body)

    one()
    for raw in (b"", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"model": 1e999}', b"{" * 50, b"null"):
        for path in ("/v1/messages", "/v1/responses"):
            check_other(http.post(path, content=raw, headers=AUTH), raw[:40])
