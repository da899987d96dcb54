"""`POST /inference/v1/generate` on `tinkerless serve`: vLLM's token route, in the exact shapes verifiers 0.4 uses.

verifiers' training client renders prompts itself and sends, through `renderers.client.generate` and the
`openai` client's `post`, `{"model", "token_ids", "sampling_params": {..., "stop_token_ids": renderer's,
"logprobs": 1, "skip_special_tokens": false}}` to `<base without /v1>/inference/v1/generate`; it reads
`choices[0].token_ids`, `choices[0].logprobs.content[i]` = `{"token": "token_id:<id>", "logprob": finite}` (one
per id), `choices[0].finish_reason` and `prompt_token_ids`. These tests send and read exactly that.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

import tinkerless
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.server.openai_api import render_chat
from tinkerless.storage import ObjectStore
from tinkerless.functions.worker import Worker

pytestmark = pytest.mark.timeout(600)
KEY = "tml-alice-key"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("generate-server")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice", "tml-bob-key": "bob"}),
                     storage=str(storage), limits=ServingLimits(max_tokens=64, max_samples=4, max_prompt_tokens=1024))
    with serve_in_thread(app) as url:
        tinkerless.train(
            model=tiny_model, name="trained", reward=lambda c, t: float(sum(map(ord, c)) % 5), tasks=[{"prompt": "hi"}],
            steps=1, batch_size=2, group_size=4, max_tokens=8, learning_rate=0.05, checkpoint_every=1,
            storage=str(tmp_path_factory.mktemp("alice-client")), progress=False, run_id="trained",
            backend=HTTPBackend(url, api_key=KEY),
        )
        yield url, app, worker


def verifiers_post(url: str, body: dict, key: str = KEY, headers: dict | None = None) -> dict:
    """As renderers' generate posts it: the openai client's `post` to the root route (not under /v1)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    options = {"headers": headers} if headers else {}
    response = client.post(f"{base}/inference/v1/generate", cast_to=httpx.Response, body=body, options=options)
    return response.json()


def verifiers_read(data: dict) -> tuple[list[int], list[float], str]:
    """What verifiers reads back, with the checks its parser makes."""
    choice = data["choices"][0]
    ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert isinstance(ids, list) and len(content) == len(ids)
    logprobs = []
    for token, entry in zip(ids, content):
        assert entry["token"] == f"token_id:{token}"
        assert isinstance(entry["logprob"], float) and math.isfinite(entry["logprob"])
        logprobs.append(entry["logprob"])
    assert choice["finish_reason"] in ("stop", "length") and isinstance(data["prompt_token_ids"], list)
    return ids, logprobs, choice["finish_reason"]


def body(model: str, prompt: list[int], **sampling) -> dict:
    params = {"max_tokens": 8, "temperature": 0.0, **sampling}
    params.setdefault("stop_token_ids", [])
    params["logprobs"], params["skip_special_tokens"] = 1, False  # always set by renderers
    return {"model": model, "token_ids": prompt, "sampling_params": params}


def own(worker, prompt: list[int], count: int, policy=None) -> tuple[list[int], list[float]]:
    tokens, logprobs = [], []
    with torch.no_grad(), worker._activate(policy):
        for _ in range(count):
            logits = worker.model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1]
            scores = torch.log_softmax(logits.float(), dim=-1)
            tokens.append(int(scores.argmax()))
            logprobs.append(float(scores[tokens[-1]]))
    return tokens, logprobs


def test_base_model_greedy_tokens_and_logprobs_are_the_models_own(server):
    url, app, worker = server
    prompt = render_chat(worker.tokenizer, [{"role": "user", "content": "Say something."}])
    data = verifiers_post(url, body(app.state.openai.base_model, prompt, ignore_eos=True))
    ids, logprobs, finish = verifiers_read(data)
    expected_ids, expected_logprobs = own(worker, prompt, 8)
    assert ids == expected_ids and finish == "length" and data["prompt_token_ids"] == prompt
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_a_stop_token_ends_the_choice_and_is_kept(server):
    url, app, worker = server
    prompt = worker.tokenizer("Once upon a time")["input_ids"]
    first = own(worker, prompt, 3)[0]
    ids, _, finish = verifiers_read(verifiers_post(url, body(app.state.openai.base_model, prompt,
                                                             stop_token_ids=[first[1]], ignore_eos=True)))
    assert ids == first[:first.index(first[1]) + 1] and finish == "stop"  # the first time the model draws it


def test_checkpoints_answer_and_differ_from_the_base(server):
    url, app, worker = server
    prompt = worker.tokenizer("hi")["input_ids"]
    base = verifiers_read(verifiers_post(url, body(app.state.openai.base_model, prompt, ignore_eos=True)))
    trained = verifiers_read(verifiers_post(url, body("trained@latest", prompt, ignore_eos=True)))
    assert trained[1][0] != pytest.approx(base[1][0], abs=1e-4)
    sampled = [verifiers_read(verifiers_post(url, body("trained@1", prompt, temperature=1.0, seed=s, ignore_eos=True)))
               for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and sampled[0][0] != sampled[2][0]  # seeded


def test_a_next_turn_as_verifiers_renderer_bridge_sends_it(server):
    """verifiers' training client does not re-render a conversation's next turn: its renderer bridge sends the
    previous prompt, the ids the route sampled, then the new messages' tokens, with `routed_experts_prompt_start`
    (the previous path's length - 1) in sampling_params and the trace id in X-Session-ID. The route takes that
    prompt as it is, whether the first reply stopped or was cut at max_tokens, and samples from it as from any."""
    url, app, worker = server
    model = app.state.openai.base_model
    tokenizer = worker.tokenizer
    tail = tokenizer("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"]
    first_prompt = render_chat(tokenizer, [{"role": "user", "content": "Say something."}])
    for ignore_eos in (True, False):  # a reply cut at max_tokens, and one the model may end itself
        first = verifiers_post(url, body(model, first_prompt, max_tokens=6, ignore_eos=ignore_eos),
                               headers={"X-Session-ID": "trace-1"})
        sampled = verifiers_read(first)[0]
        second_prompt = first_prompt + sampled + tail[int(bool(sampled) and sampled[-1] == tail[0]):]
        second = verifiers_post(url, body(model, second_prompt, max_tokens=5, ignore_eos=True,
                                          routed_experts_prompt_start=len(first_prompt) + len(sampled) - 1, seed=7),
                                headers={"X-Session-ID": "trace-1"})
        ids, logprobs, finish = verifiers_read(second)
        assert second["prompt_token_ids"] == second_prompt and finish == "length"
        expected_ids, expected_logprobs = own(worker, second_prompt, 5)
        assert ids == expected_ids and logprobs == pytest.approx(expected_logprobs, abs=1e-4)


@pytest.mark.parametrize("change, status, code", [
    ({"sampling_params": {"top_k": 5}}, 400, "unsupported_parameter"),
    ({"sampling_params": {"min_p": 0.0, "top_k": -1, "repetition_penalty": 1.0}}, 200, None),  # no-op values
    ({"sampling_params": {"temperature": -1}}, 400, None),
    ({"sampling_params": {"max_tokens": 10_000}}, 400, None),
    ({"sampling_params": {"n": 50}}, 400, None),
    ({"token_ids": []}, 400, None),
    ({"token_ids": [-1, 5]}, 400, None),
    ({"token_ids": [10**9]}, 400, None),
    ({"token_ids": "hello"}, 400, None),
    ({"model": "nobody@latest"}, 404, "model_not_found"),
    ({"content_parts": [{"type": "image"}]}, 400, "unsupported_parameter"),
])
def test_bad_requests_are_4xx_with_the_openai_error_body(server, change, status, code):
    url, app, worker = server
    request = body(app.state.openai.base_model, [1, 2, 3])
    for key, value in change.items():
        if key == "sampling_params":
            request["sampling_params"] = {**request["sampling_params"], **value}
        else:
            request[key] = value
    response = httpx.post(f"{url}/inference/v1/generate", json=request, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert error["message"] and (code is None or error["code"] == code)


def test_keys_are_required_and_scoped(server):
    url, app, worker = server
    request = body("trained@latest", [1, 2, 3])
    assert httpx.post(f"{url}/inference/v1/generate", json=request, timeout=60).status_code == 401
    other = httpx.post(f"{url}/inference/v1/generate", json=request, headers={"Authorization": "Bearer tml-bob-key"}, timeout=60)
    assert other.status_code == 404  # bob cannot reach alice's checkpoint


def test_verifiers_own_client_drives_the_route(server):
    """renderers.client.generate: the function verifiers 0.4's training client calls for every turn."""
    import asyncio

    renderers = pytest.importorskip("renderers")
    from renderers.client import generate
    from renderers.configs import DefaultRendererConfig

    url, app, worker = server
    renderer = renderers.create_renderer(worker.tokenizer, DefaultRendererConfig())
    messages = [{"role": "user", "content": "Say something."}]

    async def call(model):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        return await generate(client=client, renderer=renderer, messages=messages, model=model,
                              sampling_params={"max_tokens": 6, "temperature": 0.0})

    for model in (app.state.openai.base_model, "trained@latest"):
        result = asyncio.run(call(model))
        prompt = result["prompt_ids"]
        slot = None if model == app.state.openai.base_model else next(
            s for k, s in app.state.openai.adapters._slots.items() if k[2] == "trained")
        expected_ids, expected_logprobs = own(worker, prompt, len(result["completion_ids"]), slot)
        assert result["completion_ids"] == expected_ids and result["finish_reason"] in ("stop", "length")
        assert result["completion_logprobs"] == pytest.approx(expected_logprobs, abs=1e-4)


def test_model_cards_give_the_longest_prompt_as_vllms_max_model_len(server):
    """verifiers' training client runs renderers' pre-flight each turn: it reads `max_model_len` off the card whose
    `id` is the model in GET /v1/models (`client.get("/models")`), and refuses a longer prompt before sending it;
    verifiers' compaction reads the same field off `models.list()`'s `model_extra`. A card without it turns both
    off. The value is a boundary the route keeps: a prompt of that many tokens samples, one more is a 400."""
    url, app, worker = server
    backend = app.state.openai
    longest = backend.max_prompt_tokens
    assert longest == min(1024, worker.base_model.config.max_position_embeddings)  # the fixture's limit, here
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    cards = client.get("/models", cast_to=dict)["data"]
    names = {card["id"] for card in cards}
    assert {backend.base_model, "trained@latest"} <= names, names
    assert all(card["max_model_len"] == longest for card in cards), cards
    assert all(card.model_extra["max_model_len"] == longest for card in client.models.list().data)
    for name in ("trained@1", *sorted(backend.base_names)):  # every name the routes take, listed or not
        assert client.get(f"/models/{name}", cast_to=dict)["max_model_len"] == longest, name
    fits = verifiers_post(url, body(backend.base_model, [5] * longest, max_tokens=1))
    assert len(verifiers_read(fits)[0]) == 1
    over = httpx.post(f"{url}/inference/v1/generate", json=body(backend.base_model, [5] * (longest + 1), max_tokens=1),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert over.status_code == 400 and over.json()["error"]["param"] == "messages", over.text


def test_renderers_preflight_refuses_an_overlong_prompt_before_sending_it(server):
    """The pre-flight itself (renderers 0.1.12, as verifiers' training client calls it): with the card's cap it
    raises OverlongPromptError, which verifiers turns into a 400 its compaction recognizes, and sends nothing."""
    import asyncio

    renderers = pytest.importorskip("renderers")
    from renderers import OverlongPromptError
    from renderers.client import _max_prompt_len_cache, generate
    from renderers.configs import DefaultRendererConfig

    url, app, worker = server
    backend = app.state.openai
    renderer = renderers.create_renderer(worker.tokenizer, DefaultRendererConfig())
    sent = []

    async def call(prompt_ids):
        http = httpx.AsyncClient(event_hooks={"request": [lambda request: _record(sent, request)]}, timeout=120)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, http_client=http)
        try:
            return await generate(client=client, renderer=renderer, messages=[], model=backend.base_model,
                                  prompt_ids=prompt_ids, sampling_params={"max_tokens": 1, "temperature": 0.0})
        finally:
            await client.close()

    _max_prompt_len_cache.clear()  # a process-wide cache keyed by (base_url, model)
    with pytest.raises(OverlongPromptError):
        asyncio.run(call([5] * (backend.max_prompt_tokens + 1)))
    assert [r.url.path for r in sent] == ["/v1/models"]  # the card was read; the prompt was never sent
    assert len(asyncio.run(call([5] * 8))["completion_ids"]) == 1


async def _record(sent: list, request) -> None:
    sent.append(request)
