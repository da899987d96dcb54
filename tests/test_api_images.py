"""Images on the Anthropic Messages and OpenAI Responses routes of `tinkerless serve`, driven by the real `anthropic`
and `openai` SDKs against a served tiny random vision-language model (LLaVA-style and Qwen2.5-VL): an `image`
block and an `input_image` part are the same content part as Chat Completions' `image_url`, so a greedy reply is
the Chat Completions reply token for token; hostile images, URLs and file ids are 400s in each API's error shape,
and the server goes on serving."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

import tinkerless

from tests.scripted_model import openai_client
from tests.test_vision import _bomb_png, data_url, png
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore

pytestmark = pytest.mark.timeout(300)

KEY = "tml-alice-key"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module", params=["llava", "qwen"])
def served_vlm(request, tmp_path_factory):
    from tinkerless.functions.vision.models import build_tiny_llava, build_tiny_qwen25_vl

    build = build_tiny_llava if request.param == "llava" else build_tiny_qwen25_vl
    path = build(tmp_path_factory.mktemp("vlm") / request.param)
    storage = tmp_path_factory.mktemp("vlm-server")
    worker = Worker(path)
    app = create_app(worker, keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice"}), storage=str(storage))
    with serve_in_thread(app) as url:
        yield url, app.state.openai.base_model, worker


def _claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _chat(url: str, model: str, parts: list[dict], max_tokens: int):
    return openai_client(url, KEY).chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=max_tokens, extra_body=GREEDY)


@pytest.mark.parametrize("layout", ["text then image", "image then text", "two images"])
def test_anthropic_image_blocks_are_the_chat_completions_image_parts(served_vlm, layout):
    url, model, _ = served_vlm
    first, second = png(37, 23, seed=1), png(20, 41, seed=2)
    blocks = {"text then image": [("text", "What is it?"), ("image", first)],
              "image then text": [("image", first), ("text", "Describe.")],
              "two images": [("image", first), ("text", "and"), ("image", second)]}[layout]
    anthropic_content = [{"type": "text", "text": v} if k == "text" else
                         {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(v)}}
                         for k, v in blocks]
    chat_parts = [{"type": "text", "text": v} if k == "text" else
                  {"type": "image_url", "image_url": {"url": data_url(v)}} for k, v in blocks]
    message = _claude(url).messages.create(model=model, max_tokens=6, extra_body=GREEDY,
                                           messages=[{"role": "user", "content": anthropic_content}])
    chat = _chat(url, model, chat_parts, 6)
    assert message.content[0].text == (chat.choices[0].message.content or "")
    assert message.usage.input_tokens == chat.usage.prompt_tokens > 16  # the image's placeholder tokens are counted
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with _claude(url).messages.stream(model=model, max_tokens=6, extra_body=GREEDY,
                                      messages=[{"role": "user", "content": anthropic_content}]) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == message.content[0].text


@pytest.mark.parametrize("layout", ["image only", "text and image"])
def test_responses_input_images_are_the_chat_completions_image_parts(served_vlm, layout):
    url, model, _ = served_vlm
    picture = png(31, 29, seed=3)
    items = [{"type": "input_image", "image_url": data_url(picture)}]
    parts = [{"type": "image_url", "image_url": {"url": data_url(picture)}}]
    if layout == "text and image":
        items.insert(0, {"type": "input_text", "text": "Look:"})
        parts.insert(0, {"type": "text", "text": "Look:"})
    client = openai_client(url, KEY)
    response = client.responses.create(model=model, max_output_tokens=6, temperature=0,
                                       input=[{"role": "user", "content": items}])
    chat = _chat(url, model, parts, 6)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    # previous_response_id carries the image: the follow-up renders the whole conversation, image included
    follow = client.responses.create(model=model, max_output_tokens=3, temperature=0, input="And now?",
                                     previous_response_id=response.id)
    assert follow.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens
    events = list(client.responses.create(model=model, max_output_tokens=6, temperature=0, stream=True,
                                          input=[{"role": "user", "content": items}]))
    assert events[-1].type == f"response.{response.status}" and events[-1].response.output_text == response.output_text


HOSTILE_SOURCES = {  # Anthropic image sources a server must refuse, and a word its message must hold
    "url source": ({"type": "url", "url": "http://127.0.0.1:1/x.png"}, "never fetches"),
    "file source": ({"type": "file", "file_id": "file_123"}, "base64"),
    "20,000 x 20,000": ({"type": "base64", "media_type": "image/png", "data": _b64(_bomb_png(20_000, 20_000))},
                        "pixels"),
    "truncated": ({"type": "base64", "media_type": "image/png", "data": _b64(png()[:-40])}, "truncated"),
    "not base64": ({"type": "base64", "media_type": "image/png", "data": "@@not base64@@"}, "base64"),
    "not an image": ({"type": "base64", "media_type": "image/png", "data": _b64(b"GIF89a" + b"\0" * 40)}, "image"),
    "wrong media type": ({"type": "base64", "media_type": "image/jpeg", "data": _b64(png())}, "PNG"),
    "svg": ({"type": "base64", "media_type": "image/svg+xml", "data": _b64(b"<svg/>")}, "media type"),
    "no data": ({"type": "base64", "media_type": "image/png"}, "base64"),
}


def test_hostile_anthropic_images_are_400s_in_anthropics_shape(served_vlm):
    url, model, _ = served_vlm
    client = _claude(url)
    for name, (source, word) in HOSTILE_SOURCES.items():
        with pytest.raises(anthropic.BadRequestError) as refused:
            client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image", "source": source}]}])
        body = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (name, body)
        assert word in body["error"]["message"], (name, body)
    too_many = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(png(4, 4))}}] * 17
    with pytest.raises(anthropic.BadRequestError, match="images"):
        client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": too_many}])
    with pytest.raises(anthropic.BadRequestError, match="image"):  # images in a tool result are not taken
        client.messages.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "image", "source": HOSTILE_SOURCES["truncated"][0]}]}]}])
    ok = client.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": "still there?"}])
    assert ok.usage.output_tokens >= 1


def test_hostile_responses_images_are_400s_in_openais_shape(served_vlm):
    url, model, _ = served_vlm
    client = openai_client(url, KEY)
    hostile = {"http URL": ({"image_url": "http://127.0.0.1:1/x.png"}, "never fetches"),
               "file id": ({"file_id": "file_123"}, "file_id"),
               "20,000 x 20,000": ({"image_url": data_url(_bomb_png(20_000, 20_000))}, "pixels"),
               "truncated": ({"image_url": data_url(png()[:-40])}, "truncated"),
               "wrong media type": ({"image_url": data_url(png(), "image/gif")}, "PNG"),
               "not base64": ({"image_url": "data:image/png;base64,@@@"}, "base64")}
    for name, (fields, word) in hostile.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=model, max_output_tokens=2, input=[
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_image", **fields}]}])
        error = refused.value.body
        assert error["type"] == "invalid_request_error" and word in error["message"], (name, error)
        assert error["code"] == "invalid_image", (name, error)
    assert client.responses.create(model=model, max_output_tokens=2, input="still there?").usage.output_tokens >= 1


def test_a_text_only_model_refuses_images_on_both_routes(tiny_model, tmp_path):
    storage = tmp_path / "storage"
    app = create_app(Worker(tiny_model), keys=KeyStore(ObjectStore(str(storage)), extra_keys={KEY: "alice"}),
                     storage=str(storage))
    picture = png(8, 8)
    with serve_in_thread(app) as url:
        model = app.state.openai.base_model
        with pytest.raises(anthropic.BadRequestError, match="vision-language model"):
            _claude(url).messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": _b64(picture)}}]}])
        with pytest.raises(openai.BadRequestError, match="vision-language model"):
            openai_client(url, KEY).responses.create(model=model, max_output_tokens=2, input=[
                {"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture)}]}])


@tinkerless.agent
async def looks_twice(client, task):
    """An Anthropic image block, then the conversation sent back through Responses with a second input_image:
    one sequence holding two images."""
    claude = tinkerless.anthropic_client(client)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": task["b64"]}}
    r1 = await claude.messages.create(model="policy", max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "colour?"}, block]}])
    text = "".join(b.text for b in r1.content if b.type == "text")
    r2 = await client.responses.create(model="policy", max_output_tokens=3, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "colour?"},
                                     {"type": "input_image", "image_url": f"data:image/png;base64,{task['b64']}"}]},
        {"role": "assistant", "content": text},
        {"role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{task['b64']}"},
                                     {"type": "input_text", "text": "again?"}]}])
    return tinkerless.AgentResult(reward=1.0, metrics={"drawn": r1.usage.output_tokens + r2.usage.output_tokens})


def test_agent_functions_send_images_through_messages_and_responses_and_train_on_them(served_vlm):
    """An @tinkerless.agent whose Anthropic and Responses calls carry images: one sequence, its images recorded,
    image tokens never trained, and the update's log-probs equal the sampler's."""
    import numpy as np

    from tinkerless.wire import pack_code
    from tinkerless.wire.messages import (CreatePolicyRequest, Datum, EpisodeLimits, ForwardRequest, RolloutRequest,
                                          SamplingParams)

    _, _, worker = served_vlm
    if "p-img" not in worker.policies:
        worker.create_policy(CreatePolicyRequest("p-img"))
    tasks = [{"b64": _b64(png(30, 20, seed=s))} for s in (5, 6)]
    request = RolloutRequest("p-img", tasks, 1, SamplingParams(max_tokens=3), EpisodeLimits(max_turns=4), seed=1,
                             agent=pack_code(looks_twice))
    from tinkerless.wire import decode_message, encode_message

    result = decode_message(worker.handle("rollout", encode_message(request)))
    assert all(e.status == "ok" and e.num_turns == 2 and not e.extra_sequences for e in result.episodes), \
        [e.traceback for e in result.episodes]
    image_token = worker.vision.processor.image_token_id
    for e in result.episodes:
        assert len(e.images) == 2 and (e.tokens == image_token).sum() == sum(i.num_tokens for i in e.images)
        assert (e.mask[e.tokens == image_token] == 0).all() and e.mask.sum() == e.info["agent_metrics"]["drawn"]
    data = [Datum(e.tokens, e.mask, sampler_logprobs=e.sampler_logprobs, advantages=e.mask, images=e.images)
            for e in result.episodes]
    forward = decode_message(worker.handle("forward", encode_message(ForwardRequest("p-img", data))))
    for lp, e in zip(forward.logprobs, result.episodes):
        trained = e.mask > 0
        assert float(np.abs(lp[trained] - e.sampler_logprobs[trained]).max(initial=0.0)) < 1e-4
