"""The OpenAI API of `tinkerless serve`, driven by the official `openai` client over real HTTP.

One server (tiny model, API keys on, two tenants) for the module. Alice trains a real run on it
(two RL steps, checkpointed on the server), so `trained@1`, `trained@2` and `trained@latest` are her
adapters; bob has none. Covered: streaming, n > 1, stop strings, seeds, logprobs against the model's
own log-softmax, usage, adapter selection and its LRU cache, batching of concurrent requests for
different adapters, tenant isolation, and every bad input the issue lists (an OpenAI error body with
a 4xx, the server still serving afterwards).
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch

import tinkerless
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.server.openai_api import render_chat
from tinkerless.storage import ObjectStore

pytestmark = pytest.mark.timeout(600)

HI = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("openai-server")
    keys = {"tml-alice-key": "alice", "tml-bob-key": "bob"}  # tml-: the tinker SDK's key format
    worker = Worker(tiny_model)
    limits = ServingLimits(max_tokens=64, max_samples=8, max_prompt_tokens=1024)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys=keys), storage=str(storage),
                     limits=limits)
    with serve_in_thread(app) as url:
        # A real training run of alice's on the server: its checkpoints are her adapters.
        tinkerless.train(
            model=tiny_model, name="trained", reward=lambda c, t: float(sum(map(ord, c)) % 5), tasks=[{"prompt": "hi"}],
            steps=2, batch_size=2, group_size=4, max_tokens=8, learning_rate=0.05, checkpoint_every=1,
            storage=str(tmp_path_factory.mktemp("alice-client")), progress=False, run_id="trained",
            backend=HTTPBackend(url, api_key="tml-alice-key"),
        )
        yield url, app, worker


def client(url: str, key: str = "tml-alice-key") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def base_name(app) -> str:
    return app.state.openai.base_model


def own_logprobs(worker, prompt: list[int], tokens: list[int], policy: str | None = None) -> torch.Tensor:
    """The model's log-softmax at each sampled position, by a forward of our own."""
    with torch.no_grad(), worker._activate(policy):
        logits = worker.model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_models_lists_the_base_and_the_callers_adapters_only(server):
    url, app, _ = server
    alice = [m.id for m in client(url).models.list()]
    bob = [m.id for m in client(url, "tml-bob-key").models.list()]
    assert alice[0] == bob[0] == base_name(app)
    assert {"trained@latest", "trained@1", "trained@2"} <= set(alice)
    assert not any("trained" in m for m in bob)
    assert client(url).models.retrieve("trained@1").id == "trained@1"
    with pytest.raises(openai.NotFoundError):
        client(url, "tml-bob-key").models.retrieve("trained@1")


def test_chat_completion_usage_and_seeded_n(server):
    url, app, worker = server
    answer = client(url).chat.completions.create(model=base_name(app), messages=HI, max_tokens=12, n=3, seed=5,
                                                 temperature=1.0)
    prompt = render_chat(worker.tokenizer, HI)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.prompt_tokens == 3 * len(prompt)  # every choice reads the prompt
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert 3 <= answer.usage.completion_tokens <= 36
    assert all(c.finish_reason in ("stop", "length") and c.message.role == "assistant" for c in answer.choices)
    assert len({c.message.content for c in answer.choices}) > 1  # n independent samples
    again = client(url).chat.completions.create(model=base_name(app), messages=HI, max_tokens=12, n=3, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streaming_delivers_the_same_choices_as_one_reply(server, route):
    url, app, _ = server
    openai_client = client(url)
    args = dict(model=base_name(app), max_tokens=16, n=2, seed=11, temperature=1.0)
    if route == "chat":
        whole = openai_client.chat.completions.create(messages=HI, **args)
        stream = openai_client.chat.completions.create(messages=HI, stream=True,
                                                       stream_options={"include_usage": True}, **args)
        texts, reasons, usage = ["", ""], [None, None], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        assert texts == [c.message.content for c in whole.choices]
    else:
        whole = openai_client.completions.create(prompt="Once upon", **args)
        stream = openai_client.completions.create(prompt="Once upon", stream=True,
                                                  stream_options={"include_usage": True}, **args)
        texts, reasons, usage = ["", ""], [None, None], None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        assert texts == [c.text for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()
    # The raw wire format: SSE events, ending with the [DONE] sentinel.
    raw = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer tml-alice-key"},
                     json={"model": base_name(app), "messages": HI, "max_tokens": 3, "stream": True}, timeout=60)
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: {") for e in events[:-1])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stop_strings_cut_the_text_before_the_first_stop(server, route):
    url, app, _ = server
    openai_client = client(url)

    def sample(stop=None):
        args = dict(model=base_name(app), max_tokens=40, seed=3, temperature=1.0, stop=stop, logprobs=True)
        if route == "chat":
            choice = openai_client.chat.completions.create(messages=HI, **args).choices[0]
            return choice.message.content, choice.finish_reason, len(choice.logprobs.content)
        args["logprobs"] = 0
        choice = openai_client.completions.create(prompt="Once upon", **args).choices[0]
        return choice.text, choice.finish_reason, len(choice.logprobs.tokens)

    text, reason, _ = sample()
    assert reason == "length" and len(text) >= 8
    # Single characters, strings spanning several tokens, and lists whose later entry occurs first.
    cases = [text[5], text[2:6], [text[6:8], text[1:3]], [text[-1]]]
    for stop in cases:
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(text.find(s) for s in stops)
        got, reason, covered = sample(stop)
        assert got == text[:cut], (stop, got, text)
        assert reason == "stop"
        assert covered >= 1  # the tokens drawn up to the stop, the one completing it included
    absent = "\u2603never\u2603"
    assert sample(absent)[0] == text


def greedy(worker, prompt: list[int], count: int, policy: str | None = None) -> list[int]:
    """`count` greedy tokens by a decode loop of our own (no stop tokens): what temperature 0 must draw."""
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(own_logprobs(worker, prompt, tokens + [0], policy)[-1].argmax()))
    return tokens


def test_chat_logprobs_are_the_models_own_log_softmax(server):
    url, app, worker = server
    answer = client(url).chat.completions.create(model=base_name(app), messages=HI, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=4)
    entries = answer.choices[0].logprobs.content
    prompt = render_chat(worker.tokenizer, HI)
    tokens = greedy(worker, prompt, len(entries))
    expected = own_logprobs(worker, prompt, tokens)
    assert len(entries) == 10 and answer.choices[0].finish_reason == "length"
    for position, entry in enumerate(entries):
        assert entry.token == worker.tokenizer.decode([tokens[position]])
        assert entry.logprob == pytest.approx(float(expected[position, tokens[position]]), abs=1e-4)
        top = expected[position].topk(4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)  # greedy: the top token
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_match_the_model_and_offsets_add_up(server):
    url, app, worker = server
    choice = client(url).completions.create(model=base_name(app), prompt=[1, 2, 3, 4], max_tokens=8, temperature=0,
                                            logprobs=3).choices[0]
    logprobs = choice.logprobs
    tokens = greedy(worker, [1, 2, 3, 4], len(logprobs.tokens))
    expected = own_logprobs(worker, [1, 2, 3, 4], tokens)
    assert logprobs.token_logprobs == pytest.approx([float(expected[i, t]) for i, t in enumerate(tokens)], abs=1e-4)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert choice.text == worker.tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_trained_adapter_answers_differently_from_the_base(server):
    url, app, worker = server
    prompt = render_chat(worker.tokenizer, HI)
    answers = {}
    for model in (base_name(app), "trained@1", "trained@latest", "trained@2"):
        choice = client(url).chat.completions.create(model=model, messages=HI, max_tokens=8, temperature=0,
                                                     logprobs=True).choices[0]
        answers[model] = [e.logprob for e in choice.logprobs.content], choice.message.content
    assert answers["trained@latest"] == answers["trained@2"]
    assert answers["trained@1"][0] != pytest.approx(answers[base_name(app)][0], abs=1e-3)
    assert answers["trained@2"][0] != pytest.approx(answers["trained@1"][0], abs=1e-3)
    # The served adapter is the checkpoint's: its logprobs are the run's policy at that step, loaded here.
    slot = next(s for k, s in app.state.openai.adapters._slots.items() if k[2] == "trained" and k[4] == 2)  # (source, tenant, run, agent, step, id)
    tokens = greedy(worker, prompt, len(answers["trained@2"][0]), slot)
    expected = own_logprobs(worker, prompt, tokens, slot)
    assert answers["trained@2"][0] == pytest.approx([float(expected[i, t]) for i, t in enumerate(tokens)], abs=1e-4)


def test_adapters_stay_in_a_bounded_lru_cache(server):
    url, app, worker = server
    cache = app.state.openai.adapters
    capacity, cache.capacity = cache.capacity, 1
    try:
        loads = cache.loads
        for model in ("trained@1", "trained@1", "trained@2", "trained@2", "trained@1"):
            client(url).chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert cache.loads - loads in (2, 3)  # at most one load per switch; repeats hit the cache
        slots = [p for p in worker.policies if p.startswith("openai_slot")]
        assert len(slots) <= cache.capacity + 1  # one spare kept to reload in place
    finally:
        cache.capacity = capacity


def test_concurrent_requests_for_different_adapters_share_one_batch(server):
    url, app, worker = server
    batcher = worker.engine.batcher
    batcher.most_jobs = 0
    errors = []

    def ask(model: str) -> None:
        try:
            client(url).chat.completions.create(model=model, messages=HI, max_tokens=48, temperature=1.0,
                                                stop=None, n=2)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(m,)) for m in (base_name(app), "trained@1", "trained@2", base_name(app))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert batcher.most_jobs >= 2  # requests of different adapters decoded in one forward


def test_tenant_b_cannot_name_tenant_as_runs_or_policies(server):
    url, app, _ = server
    bob = client(url, "tml-bob-key")
    answers = {}
    for model in ("trained@latest", "trained@1", "no-such-run@latest", "trained@999"):
        with pytest.raises(openai.NotFoundError) as caught:
            bob.chat.completions.create(model=model, messages=HI, max_tokens=2)
        error = caught.value.body
        assert error["code"] == "model_not_found" and error["param"] == "model" and error["type"]
        answers[model] = error["message"].replace(repr(model), "<name>")
    assert len(set(answers.values())) == 1  # another tenant's run reads exactly like no run at all
    # Alice's live policy on the worker (the run's "default") is hers alone too.
    live = [m.id for m in client(url).models.list() if "@" not in m.id and m.id != base_name(app)]
    assert live, "alice's run left a live policy on the worker"
    with pytest.raises(openai.NotFoundError):
        bob.chat.completions.create(model=live[0], messages=HI, max_tokens=2)
    assert client(url).chat.completions.create(model=live[0], messages=HI, max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        client(url, "not-a-key").chat.completions.create(model=base_name(app), messages=HI, max_tokens=2)


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server):
    url, app, _ = server
    base = base_name(app)
    post = lambda path, body, **kw: httpx.post(  # noqa: E731
        f"{url}/v1/{path}", headers={"Authorization": "Bearer tml-alice-key", **kw.pop("headers", {})},
        content=body if isinstance(body, (bytes, str)) else json.dumps(body), timeout=60, **kw)
    cases = {
        "unknown model": ("chat/completions", {"model": "gpt-17", "messages": HI}, 404, "model_not_found"),
        "unknown adapter step": ("chat/completions", {"model": "trained@77", "messages": HI}, 404, "model_not_found"),
        "not json": ("chat/completions", b"{not json", 400, "invalid_json"),
        "not an object": ("chat/completions", [1, 2], 400, "invalid_json"),
        "no messages": ("chat/completions", {"model": base}, 400, None),
        "empty messages": ("chat/completions", {"model": base, "messages": []}, 400, None),
        "bad role": ("chat/completions", {"model": base, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        "string n": ("chat/completions", {"model": base, "messages": HI, "n": "2"}, 400, None),
        "nan temperature": ("chat/completions", '{"model": "%s", "messages": [], "temperature": NaN}' % base, 400, None),
        "image part": ("chat/completions", {"model": base, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, None),
        "n over the limit": ("chat/completions", {"model": base, "messages": HI, "n": 9}, 400, "limit_exceeded"),
        "max_tokens over the limit": ("chat/completions", {"model": base, "messages": HI, "max_tokens": 65}, 400,
                                      "limit_exceeded"),
        "prompts x n over the limit": ("completions", {"model": base, "prompt": ["a"] * 5, "n": 2}, 400,
                                       "limit_exceeded"),
        "prompt over the server's limit": ("completions", {"model": base, "prompt": [5] * 1500, "max_tokens": 1},
                                           400, "limit_exceeded"),
        "prompt longer than the context": ("completions", {"model": base, "prompt": [5] * 2100, "max_tokens": 1},
                                           400, "context_length_exceeded"),
        "an empty token-id prompt": ("completions", {"model": base, "prompt": [[1, 2], []]}, 400, None),
        "token id outside the vocabulary": ("completions", {"model": base, "prompt": [10**9]}, 400, "invalid_token_id"),
        "tool schema with a bad name": ("chat/completions", {"model": base, "messages": HI, "tools": [
            {"type": "function", "function": {"name": "no spaces allowed"}}]}, 400, None),
        "tool schema of another kind": ("chat/completions", {"model": base, "messages": HI, "tools": [
            {"type": "code_interpreter"}]}, 400, "unsupported_tool"),
        "tool parameters not an object": ("chat/completions", {"model": base, "messages": HI, "tools": [
            {"type": "function", "function": {"name": "f", "parameters": [1]}}]}, 400, None),
        "penalties": ("chat/completions", {"model": base, "messages": HI, "presence_penalty": 1.0}, 400, None),
    }
    for label, (path, body, status, code) in cases.items():
        response = post(path, body)
        assert response.status_code == status, (label, response.status_code, response.text[:300])
        error = _error(response)
        if code is not None:
            assert error["code"] == code, (label, error)
    # Prompt + max_tokens over the context, each alone within it (this server's prompt limit hides it from HTTP).
    from tinkerless.server.openai_api import OpenAIError, TokenSampling

    request = TokenSampling(prompt_ids=[5] * 2000, n=1, max_tokens=60, temperature=1.0, top_p=1.0, stop_strings=[],
                            stop_token_ids=[], seed=None, top_logprobs=0)
    with pytest.raises(OpenAIError) as caught:
        app.state.openai._check(request)
    assert caught.value.code == "context_length_exceeded" and "2048" in caught.value.message
    # The server is still serving.
    assert client(url).chat.completions.create(model=base, messages=HI, max_tokens=2).choices[0].message is not None


def test_tool_schemas_reach_the_prompt_as_toolenv_writes_them(server):
    url, app, worker = server
    tools = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                               "parameters": {"type": "object",
                                                              "properties": {"expression": {"type": "string"}},
                                                              "required": ["expression"]}}}]
    prompt = worker.tokenizer.decode(render_chat(worker.tokenizer, HI, tools))
    assert "calculator: Evaluate arithmetic." in prompt and '<tool_call>{"name": "TOOL_NAME"' in prompt
    answer = client(url).chat.completions.create(model=base_name(app), messages=HI, tools=tools, max_tokens=4)
    assert answer.usage.prompt_tokens == len(render_chat(worker.tokenizer, HI, tools))
    # tool_choice="none" renders no tools.
    plain = client(url).chat.completions.create(model=base_name(app), messages=HI, tools=tools, tool_choice="none",
                                                max_tokens=1)
    assert plain.usage.prompt_tokens == len(render_chat(worker.tokenizer, HI))


def test_tinker_checkpoints_are_models_of_their_tenant(server, tiny_model):
    """A sampler checkpoint saved through the official `tinker` SDK is a model name of its tenant only."""
    import os

    tinker = pytest.importorskip("tinker")
    os.environ["TINKER_TELEMETRY"] = "0"
    url, app, worker = server
    service = tinker.ServiceClient(base_url=url, api_key="tml-alice-key")
    try:
        training = service.create_lora_training_client(base_model=tiny_model, rank=8)
        training.forward_backward([tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0, 1.0, 1.0, 1.0]})], "cross_entropy").result()
        training.optim_step(tinker.types.AdamParams(learning_rate=0.05)).result()
        path = training.save_weights_for_sampler("served").result().path
    finally:
        service.close(status="success")
    assert path.startswith("tinker://") and path in [m.id for m in client(url).models.list()]
    tuned = client(url).completions.create(model=path, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=0)
    base = client(url).completions.create(model=base_name(app), prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                          logprobs=0)
    assert tuned.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    for other in (path, path.replace("/served", "/missing")):
        with pytest.raises(openai.NotFoundError):
            client(url, "tml-bob-key").completions.create(model=other, prompt=[5, 6, 7], max_tokens=2)
