"""The OpenAI routes' boundary: uniform error bodies, every accepted model name on /v1/models/{name}, and
over-long prompts refused on their length before any tokenizing."""

from __future__ import annotations

import time

import httpx
import pytest

from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore

AUTH = {"Authorization": "Bearer tml-alice-key"}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    from tinkerless.functions.worker import Worker

    storage = tmp_path_factory.mktemp("openai-errors")
    app = create_app(Worker(tiny_model), keys=KeyStore(ObjectStore(str(storage)), extra_keys={"tml-alice-key": "alice"}),
                     storage=str(storage), limits=ServingLimits(max_tokens=8, max_samples=4, max_prompt_tokens=512))
    with serve_in_thread(app) as url:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
            yield http, app


def test_every_name_chat_accepts_resolves_on_the_models_route(server):
    http, app = server
    backend = app.state.openai
    for name in sorted(backend.base_names):
        chat = http.post("/v1/chat/completions", json={"model": name, "messages": HI, "max_tokens": 1})
        assert chat.status_code == 200, (name, chat.text)
        card = http.get(f"/v1/models/{name}")
        assert card.status_code == 200 and card.json()["id"] == name, (name, card.text)
    for unknown in ("nope", "run@latest", "..%2Fx", "smollm2x", "a/b@1"):
        assert http.get(f"/v1/models/{unknown}").json()["error"]["code"] == "model_not_found", unknown
    for path in ("/v1/nope", "/v1/chat", "/v1/completions/x"):  # no route: the same body, typed
        error = http.get(path).json()["error"]
        assert error["code"] == "not_found" and error["type"] == "invalid_request_error" and error["message"]
    assert http.get("/v1/chat/completions").json()["error"]["code"] == "method_not_allowed"


CASES = [  # (route, body, expected param, expected code)
    ("chat", {"messages": HI, "tools": [{"type": "retrieval"}]}, "tools[0]", "unsupported_tool"),
    ("chat", {"messages": HI, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "unsupported_tool"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_role"),
    ("chat", {"messages": [*HI, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "invalid_tool_arguments"),
    ("chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [None]}]}, "messages[1].tool_calls[0]",
     "invalid_value"),  # found by the fuzz at a larger count: a TypeError (500) before
    ("completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("completions", {"prompt": []}, "prompt", "invalid_value"),
    ("chat", {"messages": HI, "stop": ["", "x"]}, "stop", "invalid_value"),
    ("chat", {"messages": HI, "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ("chat", {"messages": HI, "frequency_penalty": 1.0}, "frequency_penalty", "unsupported_parameter"),
    ("chat", {"messages": HI, "logit_bias": {"1": 5}}, "logit_bias", "unsupported_parameter"),
    ("chat", {"messages": HI, "response_format": {"type": "yaml"}}, "response_format", "invalid_value"),
    ("chat", {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {}}}}}, "response_format.json_schema.schema", "unsupported_schema"),
    ("chat", {"messages": HI, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ("completions", {"prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix", "unsupported_parameter"),
    ("completions", {"prompt": "x", "best_of": 3}, "best_of", "unsupported_parameter"),
    ("chat", {"messages": HI, "n": 0}, "n", "invalid_value"),
    ("chat", {"messages": HI, "temperature": "hot"}, "temperature", "invalid_value"),
    ("chat", {"messages": HI, "max_tokens": 100}, "max_tokens", "limit_exceeded"),
]


@pytest.mark.parametrize("route, extra, param, code", CASES)
def test_every_4xx_body_has_type_code_param_and_a_plain_message(server, route, extra, param, code):
    http, app = server
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    reply = http.post(path, json={"model": app.state.openai.base_model, "max_tokens": 2, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    assert error["message"] and "Value error" not in error["message"], error


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(server, monkeypatch):
    http, app = server
    backend = app.state.openai
    import tinkerless.functions.openai_api.router as router

    def never(*args, **kwargs):
        raise AssertionError("tokenized a prompt that its length alone refuses")

    monkeypatch.setattr(router, "render_chat", never)
    monkeypatch.setattr(router, "_encode", never)
    huge = "x" * (2 * 1024 * 1024)
    assert len(huge) > backend.prompt_char_limit
    started = time.perf_counter()
    chat = http.post("/v1/chat/completions", json={"model": backend.base_model, "messages": [
        {"role": "user", "content": [{"type": "text", "text": huge}]}]})
    completion = http.post("/v1/completions", json={"model": backend.base_model, "prompt": ["ok", huge]})
    for reply, param in ((chat, "messages"), (completion, "prompt")):
        assert reply.status_code == 400
        assert (reply.json()["error"]["code"], reply.json()["error"]["param"]) == ("context_length_exceeded", param)
    assert time.perf_counter() - started < 1.0  # two 2 MB bodies parsed and refused, nothing tokenized


def test_the_character_bound_never_refuses_a_prompt_that_fits(server):
    """The bound is sound: a prompt of exactly max_prompt_tokens of the longest token passes the cheap check."""
    http, app = server
    backend = app.state.openai
    vocab = backend.tokenizer().get_vocab()
    longest = max(vocab, key=len)
    assert len(longest) == backend.max_token_chars
    text = backend.tokenizer().convert_tokens_to_string([longest])
    assert len(text) <= backend.max_token_chars  # what it decodes to is never longer than its spelling
