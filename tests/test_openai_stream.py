"""Token-by-token SSE streaming of `tinkerless serve`'s OpenAI routes, with the official `openai` client over
real HTTP on the tiny model.

A streamed request must give what the same request (same seed) gives without streaming: text, token logprobs
and top logprobs, finish reasons, usage; for chat and completions, n > 1, stop strings that span tokens, and
multi-byte text (the tiny model draws random bytes). It must also really stream: the first chunk reaches the
client while the engine is still drawing the request's tokens, and a client that hangs up ends its job (stop
reason "cancelled") without stopping the server. An error before the first byte is an HTTP 4xx; after it, an
SSE `error` event that the client raises.
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.server.openai_api import error_body
from tinkerless.functions.openai_api.backend import OpenAIError
from tinkerless.functions.openai_api.streaming import sse_response
from tinkerless.storage import ObjectStore

pytestmark = pytest.mark.timeout(600)

HI = [{"role": "user", "content": "Say something."}]
LONG = 1000  # greedy on the tiny model never draws its end of turn here: 1000 tokens, a few seconds


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("stream-server")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={"tml-alice-key": "alice"}),
                     storage=str(storage), limits=ServingLimits(max_tokens=LONG, max_samples=4))
    with serve_in_thread(app) as url:
        yield url, app, worker


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="tml-alice-key", max_retries=0, timeout=120)


def base(app) -> str:
    return app.state.openai.base_model


def collect(stream, n: int, chat: bool) -> dict:
    """Texts, token logprobs, top logprobs, finish reasons and usage of a stream, per choice index."""
    out = {"text": [""] * n, "logprobs": [[] for _ in range(n)], "top": [[] for _ in range(n)],
           "reasons": [None] * n, "usage": None, "tool_calls": [[] for _ in range(n)]}
    for chunk in stream:
        if chunk.usage is not None:
            out["usage"] = chunk.usage.model_dump()
        for choice in chunk.choices:
            i = choice.index
            out["reasons"][i] = choice.finish_reason or out["reasons"][i]
            if chat:
                out["text"][i] += choice.delta.content or ""
                out["tool_calls"][i] += choice.delta.tool_calls or []
                entries = choice.logprobs.content if choice.logprobs is not None else []
                out["logprobs"][i] += [e.logprob for e in entries]
                out["top"][i] += [[(t.token, t.logprob) for t in e.top_logprobs] for e in entries]
            else:
                out["text"][i] += choice.text
                if choice.logprobs is not None:
                    out["logprobs"][i] += choice.logprobs.token_logprobs
                    out["top"][i] += [sorted(t.items()) for t in choice.logprobs.top_logprobs]
    return out


def whole(reply, chat: bool) -> dict:
    if chat:
        return {"text": [c.message.content or "" for c in reply.choices],
                "logprobs": [[e.logprob for e in c.logprobs.content] for c in reply.choices],
                "top": [[[(t.token, t.logprob) for t in e.top_logprobs] for e in c.logprobs.content]
                        for c in reply.choices],
                "reasons": [c.finish_reason for c in reply.choices], "usage": reply.usage.model_dump()}
    return {"text": [c.text for c in reply.choices],
            "logprobs": [c.logprobs.token_logprobs for c in reply.choices],
            "top": [[sorted(t.items()) for t in c.logprobs.top_logprobs] for c in reply.choices],
            "reasons": [c.finish_reason for c in reply.choices], "usage": reply.usage.model_dump()}


def assert_same(streamed: dict, expected: dict) -> None:
    assert streamed["text"] == expected["text"]
    assert streamed["reasons"] == expected["reasons"]
    assert streamed["usage"] == expected["usage"]
    for got, want in zip(streamed["logprobs"], expected["logprobs"]):
        assert got == pytest.approx(want, abs=1e-4)
    for got, want in zip(streamed["top"], expected["top"]):
        assert [[t for t, _ in pos] for pos in got] == [[t for t, _ in pos] for pos in want]
        assert [lp for pos in got for _, lp in pos] == pytest.approx([lp for pos in want for _, lp in pos], abs=1e-4)


def request(openai_client, route: str, stream: bool, **args):
    if route == "chat":
        return openai_client.chat.completions.create(
            messages=HI, stream=stream, logprobs=True, top_logprobs=3,
            **({"stream_options": {"include_usage": True}} if stream else {}), **args)
    return openai_client.completions.create(
        prompt="Once upon a time", stream=stream, logprobs=3,
        **({"stream_options": {"include_usage": True}} if stream else {}), **args)


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_choices_equal_the_unstreamed_ones(server, route, seed):
    url, app, _ = server
    args = dict(model=base(app), max_tokens=48, n=2, seed=seed, temperature=1.0)
    expected = whole(request(client(url), route, False, **args), route == "chat")
    streamed = collect(request(client(url), route, True, **args), 2, route == "chat")
    assert_same(streamed, expected)
    assert len(set(streamed["text"])) == 2  # two independent samples, each on its own index


def test_multibyte_text_streams_whole_characters(server):
    """The tiny model draws random bytes: some complete multi-byte characters, split across tokens."""
    url, app, _ = server
    texts = []
    for seed in range(4):
        args = dict(model=base(app), max_tokens=64, n=2, seed=seed, temperature=1.0)
        expected = whole(request(client(url), "completions", False, **args), False)
        assert_same(collect(request(client(url), "completions", True, **args), 2, False), expected)
        texts += expected["text"]
    assert any(ord(c) > 127 and c != "\ufffd" for text in texts for c in text)  # real multi-byte characters


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stop_strings_spanning_tokens_cut_the_stream_as_the_reply(server, route):
    url, app, _ = server
    args = dict(model=base(app), max_tokens=48, n=2, seed=4, temperature=1.0)
    free = whole(request(client(url), route, False, **args), route == "chat")["text"]
    # Three characters from the middle of each choice: three tokens at least (a byte-level tokenizer).
    stops = [text[10:13] for text in free if len(text) > 14][:2]
    assert stops
    expected = whole(request(client(url), route, False, stop=stops, **args), route == "chat")
    streamed = collect(request(client(url), route, True, stop=stops, **args), 2, route == "chat")
    assert_same(streamed, expected)
    assert "stop" in streamed["reasons"] and not any(s in t for s in stops for t in streamed["text"])


def test_chat_with_tools_streams_the_same_reply(server):
    url, app, _ = server
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object", "properties": {}}}}]
    args = dict(model=base(app), max_tokens=32, n=2, seed=9, temperature=1.0, tools=tools)
    expected = whole(request(client(url), "chat", False, **args), True)
    assert_same(collect(request(client(url), "chat", True, **args), 2, True), expected)


def test_the_first_chunk_arrives_while_the_engine_is_still_drawing(server):
    url, app, worker = server
    batcher = worker.engine.batcher
    before = batcher.decoded_tokens
    stream = client(url).completions.create(model=base(app), prompt="hello", max_tokens=LONG, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)
    decoded_at_first = batcher.decoded_tokens - before  # tokens the engine had decoded when the chunk was read
    started = time.perf_counter()
    rest = list(chunks)
    drawn = rest[-1].usage.completion_tokens
    assert first.choices[0].text and drawn == LONG
    # Causal: the engine decoded more of this request's tokens after the client already had the first chunk.
    assert decoded_at_first < drawn - 100, (decoded_at_first, drawn)
    assert batcher.decoded_tokens - before >= drawn - 1
    assert time.perf_counter() - started > 0  # (the rest took real time: the stream was not finished)


def test_a_client_that_hangs_up_cancels_its_generation(server):
    url, app, worker = server
    backend, batcher = app.state.openai, worker.engine.batcher
    cancelled, before = backend.cancelled_choices, batcher.decoded_tokens
    stream = client(url).chat.completions.create(model=base(app), messages=HI, max_tokens=LONG, temperature=0.0,
                                                 n=2, stream=True)
    chunks = iter(stream)
    for _ in range(6):
        next(chunks)
    stream.close()  # hang up mid-stream
    deadline = time.monotonic() + 60
    while backend.cancelled_choices < cancelled + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert backend.cancelled_choices == cancelled + 2  # both rows ended with stop reason "cancelled"
    assert batcher.rows == 0
    assert batcher.decoded_tokens - before < 2 * (LONG - 100)  # far from the 2 x 1000 tokens asked for
    # The server goes on serving, streamed or not.
    again = client(url).chat.completions.create(model=base(app), messages=HI, max_tokens=5, seed=1)
    assert again.usage.completion_tokens >= 1
    assert collect(client(url).chat.completions.create(model=base(app), messages=HI, max_tokens=5, seed=1,
                                                       stream=True), 1, True)["text"] == [again.choices[0].message.content]


def test_errors_before_the_first_byte_are_http_errors(server):
    url, app, _ = server
    with pytest.raises(openai.NotFoundError):
        client(url).chat.completions.create(model="nobody@latest", messages=HI, stream=True)
    with pytest.raises(openai.BadRequestError) as info:
        client(url).chat.completions.create(model=base(app), messages=HI, n=5, stream=True)  # over max_samples
    assert info.value.code == "limit_exceeded"
    with pytest.raises(openai.BadRequestError):
        client(url).completions.create(model=base(app), prompt="hi", max_tokens=LONG + 1, stream=True)
    raw = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer tml-alice-key"},
                     json={"model": base(app), "messages": HI, "stream": True, "max_tokens": 3}, timeout=60)
    events = [e for e in raw.text.split("\n\n") if e]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


def test_an_error_after_the_first_byte_is_an_sse_error_event():
    """Once chunks have been sent the status is 200: a failure becomes an `error` event the client raises."""
    app = FastAPI()

    async def chunks():
        yield {"id": "c", "object": "text_completion", "created": 0, "model": "m",
               "choices": [{"index": 0, "text": "partial", "logprobs": None, "finish_reason": None}]}
        raise OpenAIError("the adapter went away mid-stream", code="adapter_gone")

    @app.post("/v1/completions")
    async def route(request: Request):
        return sse_response(request, chunks(), [], error_body)

    with TestClient(app) as http:
        raw = http.post("/v1/completions", json={})
        assert raw.text.split("\n\n")[-2] == ('event: error\ndata: {"error": {"message": "the adapter went away '
                                              'mid-stream", "type": "invalid_request_error", "param": null, '
                                              '"code": "adapter_gone"}}')
        stream = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http,
                               max_retries=0).completions.create(model="m", prompt="x", stream=True)
        received = []
        with pytest.raises(openai.APIError, match="went away"):
            for chunk in stream:
                received.append(chunk.choices[0].text)
        assert received == ["partial"]


def test_the_engine_streams_each_row_as_it_records_it_and_stops_when_cancelled(server):
    """Below the routes: every recorded token reaches the stream in order with its log-prob and top log-probs
    (those of the model's own log-softmax), and a cancelled stream ends the rows with "cancelled"."""
    import asyncio

    import torch

    from tinkerless.functions.sampling.token_stream import TokenStream
    from tinkerless.wire.messages import SamplingParams

    _, _, worker = server
    prompt = list(worker.tokenizer("Once upon")["input_ids"])
    sampling = SamplingParams(max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[])

    async def run(sampling: SamplingParams, cancel_after: int | None):
        stream, events = TokenStream(), []

        async def read():
            async for event in stream:
                events.append(event)
                if cancel_after is not None and len(events) == cancel_after:
                    stream.cancel()  # as the route does when its client hangs up

        reader = asyncio.create_task(read())
        generations = await asyncio.to_thread(worker.engine.generate, [prompt] * 2, sampling, policy=None, seed=3,
                                              stream=stream, top_logprobs=2)
        stream.end(generations)
        await reader
        return events, generations

    events, generations = asyncio.run(run(sampling, None))
    for row, generation in enumerate(generations):
        mine = [e for e in events if e.row == row]
        assert [e.token_id for e in mine] == generation.tokens and [e.logprob for e in mine] == generation.logprobs
        assert [e.stop_reason for e in mine] == [None] * 11 + ["length"]
        with torch.no_grad():
            logits = worker.model(input_ids=torch.tensor([prompt + generation.tokens])).logits[0, len(prompt) - 1:-1]
        own = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1)
        assert [[t for t, _ in e.top_logprobs] for e in mine] == own.indices.tolist()
        assert [lp for e in mine for _, lp in e.top_logprobs] == pytest.approx(own.values.flatten().tolist(), abs=1e-4)
        assert generation.top_logprobs == [e.top_logprobs for e in mine]

    long = SamplingParams(max_tokens=1000, temperature=1.0, top_p=1.0, top_k=0, stop_token_ids=[])
    events, generations = asyncio.run(run(long, 6))
    assert [g.stop_reason for g in generations] == ["cancelled", "cancelled"]
    assert all(6 // 2 <= len(g.tokens) < 1000 for g in generations)
    assert [e.token_id for e in events if e.row == 0] == generations[0].tokens  # the last one says "cancelled"
    assert [e.stop_reason for e in events][-2:] == ["cancelled", "cancelled"]


def test_several_completion_prompts_stream_on_their_choice_indices(server):
    """Two prompts x n=2: four choices, prompt p's row r on index 2p + r, as in the full reply."""
    url, app, _ = server
    args = dict(model=base(app), prompt=["Once upon", "The sea is"], max_tokens=24, n=2, seed=8, temperature=1.0,
                logprobs=2, stop=["e "])
    expected = whole(client(url).completions.create(**args), False)
    streamed = collect(client(url).completions.create(stream=True, stream_options={"include_usage": True}, **args),
                       4, False)
    assert_same(streamed, expected)
    assert len(set(streamed["text"])) == 4


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_non_streamed_request_whose_client_times_out_is_cancelled_within_a_second(server, route):
    """The `openai` client's timeout (and its retries) must not leave jobs generating for nobody."""
    url, app, worker = server
    backend, batcher, scheduler = app.state.openai, worker.engine.batcher, app.state.scheduler
    before = batcher.decoded_tokens
    if route == "chat":
        path, body = "/v1/chat/completions", {"messages": HI}
    else:
        path, body = "/v1/completions", {"prompt": ["Say something.", "Say more."]}
    body = {**body, "model": base(app), "max_tokens": LONG, "temperature": 0.0, "n": 2}
    with pytest.raises(httpx.ReadTimeout):  # the whole job takes seconds: the client gives up first
        httpx.post(f"{url}{path}", json=body, headers={"Authorization": "Bearer tml-alice-key"}, timeout=0.4)
    gave_up = time.monotonic()
    while (batcher.rows or scheduler.in_flight or scheduler.pending) and time.monotonic() < gave_up + 5:
        time.sleep(0.01)
    idle_after = time.monotonic() - gave_up
    assert batcher.rows == 0 and scheduler.in_flight == 0 and scheduler.pending == 0
    assert idle_after < 1.0, f"the abandoned job ran on for {idle_after:.2f} s"
    rows = 2 if route == "chat" else 4
    assert batcher.decoded_tokens - before < rows * (LONG - 100)  # far from what was asked for
    assert not backend._jobs  # nothing left to cancel
    again = client(url).chat.completions.create(model=base(app), messages=HI, max_tokens=5, seed=1)
    assert again.usage.completion_tokens >= 1


def test_shutdown_cancels_the_jobs_the_openai_routes_queued(server):
    url, app, worker = server
    import threading

    result: dict = {}

    def ask() -> None:
        try:
            result["reply"] = client(url).chat.completions.create(model=base(app), messages=HI, max_tokens=LONG,
                                                                  temperature=0.0)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            result["error"] = exc

    caller = threading.Thread(target=ask)
    caller.start()
    deadline = time.monotonic() + 10
    while not app.state.openai._jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.state.cancel_jobs() >= 1  # what `tinkerless serve` calls on SIGTERM, before it drains
    caller.join(timeout=5)
    assert not caller.is_alive(), "the request outlived its cancelled job"
    reply = result["reply"]
    assert reply.usage.completion_tokens < LONG - 100
