"""Vision-language policies on tiny random LLaVA-style and Qwen2.5-VL models: images at the boundary, in rollouts
(single- and multi-turn, with kept caches), in the update, and in what is written to disk."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tinkerless.errors import ConfigError, InvalidRequest
from tinkerless.functions.losses import LossConfig
from tinkerless.wire.content import ImagePart, TextPart, VisionInput, for_disk, image_part, to_parts
from tinkerless.wire.messages import (CreatePolicyRequest, Datum, EpisodeLimits, ForwardBackwardRequest, ForwardRequest,
                                      OptimStepRequest, RolloutRequest, SamplingParams, UpdateRequest)
from tinkerless.wire.validate import validate

FAMILIES = ("llava", "qwen", "qwen3", "gemma3")


def png(width: int = 40, height: int = 30, seed: int = 0, mode: str = "RGB") -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def _bomb_png(width: int, height: int) -> bytes:
    """A valid small PNG whose header declares width x height (its IHDR rewritten, CRC fixed)."""
    data = bytearray(png(8, 8))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return bytes(data)


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _rollout_with(content) -> RolloutRequest:
    task = {"messages": [{"role": "user", "content": content}]}
    return RolloutRequest("p1", [task], 1, SamplingParams(max_tokens=2), EpisodeLimits(), 0)


def _cmyk_jpeg() -> bytes:
    buffer = io.BytesIO()
    Image.new("CMYK", (8, 8)).save(buffer, format="JPEG")
    return buffer.getvalue()


HOSTILE = {
    "truncated": lambda: [{"type": "image_url", "image_url": {"url": data_url(png()[:-30])}}],
    "truncated end": lambda: [{"type": "image_url", "image_url": {"url": data_url(png(8, 8)[:-6])}}],
    "20,000 x 20,000": lambda: [{"type": "image_url", "image_url": {"url": data_url(_bomb_png(20_000, 20_000))}}],
    "1,000 images": lambda: [{"type": "image_url", "image_url": data_url(png(4, 4))}] * 1000,
    "NaN array": lambda: [{"type": "image", "image": np.full((8, 8, 3), np.nan, np.float32)}],
    "wrong mode": lambda: [ImagePart(_cmyk_jpeg(), "image/jpeg")],
    "http URL": lambda: [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}],
    "60 MB base64": lambda: [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (60 << 20)}}],
    "not an image": lambda: [ImagePart(b"GIF89a but not really", "image/gif")],
    "wrong media type": lambda: [ImagePart(png(), "image/jpeg")],
    "array shape": lambda: [{"type": "image", "image": np.zeros((4, 4, 2), np.uint8)}],
    "array dtype": lambda: [{"type": "image", "image": np.zeros((4, 4), np.int64)}],
    "unknown part": lambda: [{"type": "audio", "audio": "x"}],
}
FAULT_WORDS = {"truncated": "truncated", "truncated end": "truncated", "20,000 x 20,000": "pixels", "1,000 images": "images",
               "NaN array": "NaN", "wrong mode": "mode", "http URL": "URL", "60 MB base64": "MB",
               "not an image": "not a readable image", "wrong media type": "media_type", "array shape": "shape",
               "array dtype": "dtype", "unknown part": "type"}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_images_are_refused_at_the_boundary_naming_the_fault(name):
    with pytest.raises(InvalidRequest) as refused:
        validate(_rollout_with(HOSTILE[name]()))
    if name == "1,000 images":  # and spread over a request's tasks, one per message
        many = RolloutRequest("p1", [{"prompt": "x", "images": [image_part(png(4, 4, seed=i))]} for i in range(1000)],
                              1, SamplingParams(), EpisodeLimits(), 0)
        with pytest.raises(InvalidRequest, match="images, more than"):
            validate(many)
    assert refused.value.category == "user"
    assert FAULT_WORDS[name].lower() in refused.value.message.lower(), refused.value.message


def test_every_user_form_of_an_image_becomes_the_same_part(tmp_path):
    pixels = (np.random.RandomState(1).rand(12, 10, 3) * 255).astype(np.uint8)
    path = tmp_path / "x.png"
    Image.fromarray(pixels).save(path)
    part = image_part(pixels)
    forms = [Image.fromarray(pixels), str(path), path, data_url(path.read_bytes()), pixels.astype(np.float32) / 255,
             {"type": "image_url", "image_url": {"url": data_url(path.read_bytes())}},
             {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": base64.b64encode(path.read_bytes()).decode()}}]
    for form in forms:
        parts = to_parts(["look:", form if isinstance(form, dict) else {"type": "image", "image": form}])
        assert isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart)
        decoded = np.asarray(Image.open(io.BytesIO(parts[1].data)).convert("RGB"))
        assert np.array_equal(decoded, pixels), form if not isinstance(form, np.ndarray) else form.dtype
    assert for_disk([{"role": "user", "content": [part]}]) == [{"role": "user", "content": [
        {"type": "image", "sha256": part.sha256, "media_type": "image/png", "bytes": len(part.data)}]}]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory):
    from tinkerless.functions.vision.models import (build_tiny_gemma3, build_tiny_llava, build_tiny_qwen3_vl,
                                                    build_tiny_qwen25_vl)
    from tinkerless.functions.worker import Worker

    build = {"llava": build_tiny_llava, "qwen": build_tiny_qwen25_vl, "qwen3": build_tiny_qwen3_vl, "gemma3": build_tiny_gemma3}[request.param]
    worker = Worker(build(tmp_path_factory.mktemp("vlm") / request.param, initializer_range=0.2))
    worker.create_policy(CreatePolicyRequest("p1"))
    return worker


def _one_family_is_enough(vlm) -> None:
    """The code under test is the same for both families past the inputs: run it on one (the suite's time)."""
    if vlm.vision.processor.family != "llava":
        pytest.skip("family-independent past the model inputs: checked on the LLaVA-style model")


def _handle(worker, method, request):
    from tinkerless.wire import decode_message, encode_message

    return decode_message(worker.handle(method, encode_message(request)))


def _gap(result, episodes) -> float:
    worst = 0.0
    for lp, e in zip(result.logprobs, episodes):
        trained = e.mask > 0
        worst = max(worst, float(np.abs(lp[trained] - e.sampler_logprobs[trained]).max(initial=0.0)))
    return worst


def test_single_turn_image_episodes_train_only_sampled_tokens_with_the_samplers_logprobs(vlm):
    images = [image_part(png(40 + 9 * i, 30 + 5 * i, seed=i)) for i in range(3)]
    tasks = [{"prompt": f"colour {i}?", "images": [images[i]] + ([images[0]] if i == 2 else [])} for i in range(3)]
    request = RolloutRequest("p1", tasks, 3, SamplingParams(max_tokens=6), EpisodeLimits(), seed=5)
    result = _handle(vlm, "rollout", request)
    image_token = vlm.vision.processor.image_token_id
    assert all(e.status == "ok" for e in result.episodes)
    for e in result.episodes:
        at_images = e.tokens == image_token
        assert at_images.sum() == sum(i.num_tokens for i in e.images) > 0
        assert (e.mask[at_images] == 0).all() and (e.mask[: e.prompt_length] == 0).all()
        assert e.mask[e.prompt_length:].sum() == len(e.tokens) - e.prompt_length  # every sampled token trains
        assert isinstance(e.transcript[-2]["content"][0], ImagePart)  # what a reward sees
    # Different images give different samples' distributions: the images reached the model.
    data = [Datum(e.tokens, e.mask, sampler_logprobs=e.sampler_logprobs, advantages=e.mask * (1.0 - 2 * (i % 2)),
                  images=e.images) for i, e in enumerate(result.episodes)]
    assert _gap(_handle(vlm, "forward", ForwardRequest("p1", data)), result.episodes) < 1e-4
    update = _handle(vlm, "update", UpdateRequest("p1", data, LossConfig()))
    assert update.metrics["logprob_gap"] < 1e-4 and update.metrics["grad_norm"] > 0
    # Same seed, same tokens; and the samples after the update still agree with the update's forward.
    again = _handle(vlm, "rollout", request)
    assert _gap(_handle(vlm, "forward", ForwardRequest("p1", [
        Datum(e.tokens, e.mask, images=e.images) for e in again.episodes])), again.episodes) < 1e-4
    without = [Datum(e.tokens, e.mask) for e in result.episodes[:1]]
    blind = _handle(vlm, "forward", ForwardRequest("p1", without))  # the image tokens' embeddings alone
    assert type(blind).__name__ == "ErrorReply" or _gap(blind, result.episodes[:1]) > 1e-3


class ShowsImages:
    """Each turn shows a new image (and repeats the first once): the policy must say which colour it sees."""

    def reset(self, colour: int):
        self.turn = 0
        self.colour = colour
        return [TextPart("which colour?"), image_part(np.full((32, 32, 3), colour, np.uint8))]

    def step(self, action: str):
        import tinkerless

        self.turn += 1
        shown = [image_part(np.full((32, 32, 3), (self.colour + 40 * self.turn) % 256, np.uint8))]
        if self.turn == 2:
            shown.append(image_part(np.full((32, 32, 3), self.colour, np.uint8)))
        return tinkerless.StepResult(observation=[TextPart("and now?"), *shown], reward=0.1, done=self.turn >= 3)


def test_multi_turn_image_episodes_reuse_their_cache_and_encode_each_image_once(vlm):
    from tinkerless.wire import pack_code

    encoded_before = vlm.vision.sampler.images_encoded
    request = RolloutRequest("p1", [{"colour": 10}, {"colour": 200}], 2, SamplingParams(max_tokens=4),
                             EpisodeLimits(max_turns=4, max_episode_tokens=2048), seed=3, env=pack_code(ShowsImages))
    result = _handle(vlm, "rollout", request)
    assert all(e.status == "ok" and e.num_turns == 3 for e in result.episodes), [e.error for e in result.episodes]
    assert result.stats["cached_prompt_tokens"] > 0  # later turns prefilled only what was appended
    # 4 images an episode (1 at reset, 1 then 2 in observations): re-encoding earlier turns would take 1 + 2 + 4.
    assert vlm.vision.sampler.images_encoded - encoded_before == sum(len(e.images) for e in result.episodes)
    for e in result.episodes:
        assert len(e.images) == 4 and (e.mask[e.tokens == vlm.vision.processor.image_token_id] == 0).all()
        assert e.mask.sum() > 0
    data = [Datum(e.tokens, e.mask, sampler_logprobs=e.sampler_logprobs, advantages=e.mask, images=e.images)
            for e in result.episodes]
    assert _gap(_handle(vlm, "forward", ForwardRequest("p1", data)), result.episodes) < 1e-4
    record = json.dumps(for_disk(result.episodes[0].transcript))
    assert "sha256" in record and len(record) < 4000  # references, not bytes


def test_update_encodes_each_image_once_across_micro_batches(vlm, monkeypatch):
    _one_family_is_enough(vlm)
    from tinkerless.functions.vision import training

    image = image_part(png(seed=9))
    request = RolloutRequest("p1", [{"prompt": "x", "images": [image]}], 4, SamplingParams(max_tokens=3),
                             EpisodeLimits(), seed=1)
    episodes = _handle(vlm, "rollout", request).episodes
    calls = []
    real = training.encode_images
    monkeypatch.setattr(training, "encode_images", lambda model, images: calls.append(len(images)) or real(model, images))
    data = [Datum(e.tokens, e.mask, sampler_logprobs=e.sampler_logprobs, advantages=e.mask, images=e.images)
            for e in episodes]
    vlm.micro_batch_size = 1
    try:
        _handle(vlm, "forward", ForwardRequest("p1", data))
    finally:
        vlm.micro_batch_size = 16
    assert calls == [4]  # one call for the batch: 4 references, one distinct image inside encode_images


def test_lora_trains_the_language_model_only_unless_asked(vlm):
    from tinkerless.wire.messages import LoraConfig

    def trained(name):
        return {n.split(".lora_")[0] for n, p in vlm.model.named_parameters() if p.requires_grad and f".{name}." in n}

    first = trained("p1")
    assert first and all(".language_model." in n for n in first)
    if vlm.vision.processor.family == "gemma3":  # its projector is a bare weight matrix: no LoRA can go on it
        with pytest.raises(ConfigError, match="connector has no linear layer"):
            vlm.create_policy(CreatePolicyRequest("pc", LoraConfig(rank=2, vision="connector")))
        return
    vlm.create_policy(CreatePolicyRequest("pc", LoraConfig(rank=2, vision="connector")))
    # A second adapter goes on the same layers as the first (not on the first's LoRA layers), plus the connector.
    assert {n for n in trained("pc") if ".language_model." in n} == first
    assert any("multi_modal_projector" in n or "merger" in n for n in trained("pc"))
    assert not any("vision_tower" in n or "visual.blocks" in n for n in trained("pc"))


def test_gemma3_prompts_equal_its_own_processors_ids(vlm):
    """Gemma 3's template writes `<start_of_image>` per image; its processor (Gemma3Processor, which runs without
    torchvision) expands each to the soft image tokens between newlines. The engine's render gives those ids."""
    from PIL import Image
    from transformers import Gemma3Processor

    if vlm.vision.processor.family != "gemma3":
        pytest.skip("LLaVA's render is checked against LlavaProcessor in test_vision_runs; Qwen2.5-VL's processor needs torchvision")
    tokenizer = vlm.vision.chat.chat.tokenizer
    for name in ("boi", "eoi", "image"):  # what Gemma 3's own tokenizer carries as attributes
        token = {"boi": "<start_of_image>", "eoi": "<end_of_image>", "image": "<image_soft_token>"}[name]
        setattr(tokenizer, f"{name}_token", token)
        setattr(tokenizer, f"{name}_token_id", tokenizer.convert_tokens_to_ids(token))
    processor = Gemma3Processor(image_processor=vlm.vision.processor.image_processor, tokenizer=tokenizer,
                                chat_template=tokenizer.chat_template, image_seq_length=vlm.base_model.config.mm_tokens_per_image)
    pictures = [png(20 + 7 * i, 24, seed=i) for i in range(3)]
    for content in ([0, "what?"], ["a", 1, "then", 2, "b"], [0, 0]):
        parts = [{"type": "text", "text": c} if isinstance(c, str) else {"type": "image"} for c in content]
        messages = [{"role": "system", "content": "look"}, {"role": "user", "content": parts}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [Image.open(io.BytesIO(pictures[c])) for c in content if isinstance(c, int)]
        expected = processor(images=images, text=[text], return_tensors="np")["input_ids"][0].tolist()
        ours = [{**m, "content": [p if p["type"] == "text" else image_part(pictures[c])
                                  for p, c in zip(m["content"], content)]} if m["role"] == "user" else m for m in messages]
        tokens, shown = vlm.vision.chat.prompt(ours)
        assert tokens == expected and len(shown) == len(images)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed here")
@pytest.mark.parametrize("processor", ["Idefics3ImageProcessor", "SmolVLMImageProcessor"])
def test_a_model_whose_image_processor_needs_torchvision_is_refused_naming_it(processor, tmp_path):
    from tinkerless.functions.vision.models import load_vision_model

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": processor}))
    with pytest.raises(ConfigError, match=f"{processor}.*needs torchvision") as caught:
        load_vision_model(str(tmp_path), dtype=None, device="cpu")  # refused before any weights are read
    assert caught.value.category == "user"


def test_the_engines_image_inputs_give_the_models_own_logits(vlm):
    """The features merged into the embeddings (plus Qwen-VL's positions, Qwen3-VL's DeepStack, Gemma 3's
    bidirectional image attention) give the logits of the model's own forward with pixel values."""
    import torch

    from tinkerless.functions.vision.inputs import (attention_inputs, deepstack, encode_images, merged_embeddings,
                                                    position_ids, unwrap)

    processor, model = vlm.vision.processor, unwrap(vlm.model)
    messages = [{"role": "user", "content": [TextPart("a"), image_part(png(40, 50, seed=1)), TextPart("b"),
                                             image_part(png(30, 20, seed=2))]}]
    tokens, parts = vlm.vision.chat.prompt(messages)
    images = [processor.process(p) for p in parts]
    ids = torch.tensor([tokens])
    own = {"pixel_values": torch.as_tensor(np.concatenate([i.pixel_values for i in images]) if images[0].grid_thw
                                           else np.stack([i.pixel_values for i in images]))}
    if images[0].grid_thw:
        own |= {"image_grid_thw": torch.tensor([i.grid_thw for i in images]),
                "mm_token_type_ids": (ids == processor.image_token_id).int()}
    with torch.no_grad():
        expected = model(input_ids=ids, **own, **attention_inputs(model, ids)).logits
        features = encode_images(model, images)
        with deepstack(model, ids, [images], features):
            ours = model(inputs_embeds=merged_embeddings(model, ids, [images], features, processor.image_token_id),
                         position_ids=position_ids(model, ids, [images]), **attention_inputs(model, ids)).logits
    assert torch.allclose(ours, expected, atol=1e-5), (ours - expected).abs().max()


def test_a_forged_processed_image_is_a_4xx(vlm):
    good = _handle(vlm, "rollout", RolloutRequest("p1", [{"prompt": "x", "images": [image_part(png())]}], 1,
                                                  SamplingParams(max_tokens=2), EpisodeLimits(), 0)).episodes[0]
    forged = [
        VisionInput(good.images[0].sha256, good.images[0].pixel_values[:1], good.images[0].grid_thw, good.images[0].num_tokens),
        VisionInput(good.images[0].sha256, np.full_like(good.images[0].pixel_values, np.nan), good.images[0].grid_thw,
                    good.images[0].num_tokens),
        VisionInput("z" * 64, good.images[0].pixel_values, good.images[0].grid_thw, good.images[0].num_tokens),
    ]
    for image in forged:
        reply = _handle(vlm, "forward", ForwardRequest("p1", [Datum(good.tokens, good.mask, images=[image])]))
        assert type(reply).__name__ == "ErrorReply" and reply.category == "user", reply
    reply = _handle(vlm, "forward", ForwardRequest("p1", [Datum(good.tokens, good.mask, images=good.images * 2)]))
    assert type(reply).__name__ == "ErrorReply" and reply.category == "user"


def test_the_memory_planner_counts_the_vision_tower(vlm):
    from tinkerless.functions.memory_plan import ModelShape
    from tinkerless.functions.vision.inputs import unwrap

    shape = ModelShape.of(vlm.model_name)
    model = unwrap(vlm.model)
    real = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    tower = sum(p.numel() for n, p in model.named_parameters()
                if "lora_" not in n and any(k in n for k in ("vision_tower", "visual", "multi_modal_projector")))
    assert shape.vision_params > 0
    assert 0.8 < shape.vision_params / tower < 1.2, (shape.vision_params, tower)
    assert 0.8 < shape.params() / real < 1.2, (shape.params(), real)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_served_vlm_refuses_hostile_images_with_4xx_and_goes_on_serving(tmp_path):
    """`tinkerless serve` on a tiny LLaVA: the issue's hostile images over HTTP, then the schema fuzz's draws on
    every field of the image-carrying requests, then a real image rollout and a text sample still answer."""
    from fuzz_cases import POLICY, _encode, fuzzed_server, still_serves
    from hypothesis import HealthCheck, given, settings, strategies as st
    from schema_fuzz import field_paths, hostile_for, image_templates, replaced

    from tinkerless.functions.vision.models import build_tiny_llava
    from tinkerless.wire import decode_message
    from tinkerless.wire.http import MSGPACK
    from tinkerless.wire.messages import ErrorReply, RolloutResult

    def post(path: str, body) -> object:
        response = target.http.post(target.url + path.split("#")[0], content=_encode(body),
                                    headers={**target.auth(), "Content-Type": MSGPACK})
        reply = decode_message(response.content)
        assert response.status_code < 500, (path, str(body)[:200], getattr(reply, "traceback", reply))
        if response.status_code >= 400:
            assert isinstance(reply, ErrorReply) and reply.category == "user", reply
        return reply

    with fuzzed_server(build_tiny_llava(tmp_path / "llava"), tmp_path / "storage") as target:
        for name, content in HOSTILE.items():
            request = _rollout_with(content())
            request.policy = POLICY
            reply = post("/v1/call/rollout", request)
            assert isinstance(reply, ErrorReply) and reply.category == "user", name
        templates = image_templates()
        cases = [(path, where, hint) for path, t in templates.items() for where, hint in field_paths(t)]

        @settings(max_examples=30, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(data=st.data())
        def one(data):
            path, where, hint = data.draw(st.sampled_from(cases))
            post(path, replaced(templates[path], where, data.draw(hostile_for(hint))))

        one()
        result = post("/v1/call/rollout", templates["/v1/call/rollout#images"])
        assert isinstance(result, RolloutResult) and all(e.status == "ok" and e.images for e in result.episodes)
        _openai_route_answers_with_images(target)
        still_serves(target)


def _openai_route_answers_with_images(target) -> None:
    """/v1/chat/completions with an image_url part answers (the base model, greedy, with log-probs); a URL to
    fetch, a decompression bomb or a truncated image is a 400 naming the fault."""
    models = target.http.get(f"{target.url}/v1/models", headers=target.auth()).json()["data"]
    model = models[0]["id"]
    picture = data_url(png(37, 23, seed=4))
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                             {"type": "image_url", "image_url": {"url": picture}}]}]
    body = {"model": model, "messages": messages, "max_tokens": 5, "temperature": 0, "logprobs": True}
    reply = target.http.post(f"{target.url}/v1/chat/completions", json=body, headers=target.auth())
    assert reply.status_code == 200, reply.text
    tokens = [t["token"] for t in reply.json()["choices"][0]["logprobs"]["content"]]
    assert len(tokens) >= 1
    for url, word in (("http://127.0.0.1:1/x.png", "URL"), (data_url(_bomb_png(20_000, 20_000)), "pixels"),
                      (data_url(png()[:-40]), "truncated")):
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        refused = target.http.post(f"{target.url}/v1/chat/completions", headers=target.auth(),
                                   json={"model": model, "messages": bad, "max_tokens": 2})
        assert refused.status_code == 400 and word in refused.json()["error"]["message"], refused.text


def test_a_datum_whose_targets_include_image_tokens_scores_them_0_and_trains_finite(vlm):
    """Tinker-style datums score every position: image tokens report log-prob 0 and never train (mask or not)."""
    _one_family_is_enough(vlm)
    good = _handle(vlm, "rollout", RolloutRequest("p1", [{"prompt": "x", "images": [image_part(png(seed=3))]}], 2,
                                                  SamplingParams(max_tokens=3), EpisodeLimits(), 0)).episodes
    data = [Datum(e.tokens, np.ones_like(e.mask), advantages=np.ones_like(e.mask), images=e.images) for e in good]
    data[0].mask[0] = 0.0
    forward = _handle(vlm, "forward", ForwardRequest("p1", data))
    at_images = good[0].tokens == vlm.vision.processor.image_token_id
    assert np.isfinite(forward.logprobs[0]).all() and (forward.logprobs[0][at_images] == 0).all()
    update = _handle(vlm, "forward_backward", ForwardBackwardRequest(
        "p1", data, LossConfig(name="cross_entropy", normalization="token")))
    assert all(np.isfinite(v) for v in update.metrics.values()), update.metrics
    assert update.metrics["tokens"] == sum(int((d.mask > 0).sum() - (d.tokens == vlm.vision.processor.image_token_id).sum())
                                           for d in data)
    assert vlm.optim_step(OptimStepRequest("p1")).metrics["optim_step_skipped"] == 0.0


def _looks_and_answers():
    import tinkerless

    @tinkerless.agent
    async def looks(client, task):
        """Shows the task's picture, then sends the reply back with a second picture: two calls, one sequence."""
        first = [{"role": "user", "content": [{"type": "text", "text": "what colour?"},
                                              {"type": "image_url", "image_url": {"url": task["picture"]}}]}]
        r1 = await client.chat.completions.create(model="policy", messages=first, max_tokens=3)
        second = first + [r1.choices[0].message.model_dump(exclude_none=True),
                          {"role": "user", "content": [{"type": "image_url", "image_url": {"url": task["picture"]}},
                                                       {"type": "text", "text": "and again?"}]}]
        r2 = await client.chat.completions.create(model="policy", messages=second, max_tokens=3)
        return float(len(r2.choices[0].message.content or "") % 3) / 2

    return looks


def test_agent_functions_whose_openai_calls_carry_images_train_on_them(vlm):
    """An @tinkerless.agent's calls with image_url parts: sampled with the images, recorded with them, and the
    update's log-probs equal the sampler's; an agent sending an http:// image gets a 400 and its episode fails."""
    _one_family_is_enough(vlm)
    from tinkerless.wire import pack_code

    tasks = [{"picture": data_url(png(30, 20, seed=s))} for s in range(2)]
    request = RolloutRequest("p1", tasks, 2, SamplingParams(max_tokens=3), EpisodeLimits(max_turns=4), seed=2,
                             agent=pack_code(_looks_and_answers()))
    result = _handle(vlm, "rollout", request)
    assert all(e.status == "ok" and e.num_turns == 2 and not e.extra_sequences for e in result.episodes), \
        [e.traceback for e in result.episodes]
    _check_two_image_episodes(vlm, result.episodes)
    hostile = RolloutRequest("p1", [{"picture": "http://169.254.169.254/x.png"}], 1, SamplingParams(max_tokens=2),
                             EpisodeLimits(max_turns=4), seed=2, agent=pack_code(_looks_and_answers()))
    (failed,) = _handle(vlm, "rollout", hostile).episodes
    assert failed.status == "error" and "400" in failed.error, failed.error


def _check_two_image_episodes(worker, episodes) -> None:
    """Each episode holds its two images' tokens, masked out, and the update's log-probs equal the sampler's."""
    image_token = worker.vision.processor.image_token_id
    for e in episodes:
        assert len(e.images) == 2 and (e.tokens == image_token).sum() == sum(i.num_tokens for i in e.images)
        assert (e.mask[e.tokens == image_token] == 0).all() and e.mask.sum() > 0
    data = [Datum(e.tokens, e.mask, sampler_logprobs=e.sampler_logprobs, advantages=e.mask, images=e.images)
            for e in episodes]
    assert _gap(_handle(worker, "forward", ForwardRequest("p1", data)), episodes) < 1e-4


def test_agents_in_a_tenants_sandbox_send_images_too(tmp_path):
    """On a shared server the agent copies run in the tenant's sandboxed host and reach the model over its
    channel: their image_url calls are sampled with the images and recorded as in-process."""
    from tinkerless.functions.hosting.user_code import UserCodeHosts
    from tinkerless.functions.vision.models import build_tiny_llava
    from tinkerless.functions.worker import Worker
    from tinkerless.wire import pack_code

    hosts = UserCodeHosts()
    worker = Worker(build_tiny_llava(tmp_path / "llava", initializer_range=0.2), user_code_hosts=hosts)
    try:
        worker.create_policy(CreatePolicyRequest("p1"))
        tasks = [{"picture": data_url(png(30, 20, seed=s))} for s in range(2)]
        request = RolloutRequest("p1", tasks, 2, SamplingParams(max_tokens=3), EpisodeLimits(max_turns=4), seed=2,
                                 agent=pack_code(_looks_and_answers()))
        result = _handle(worker, "rollout", request)
        assert result.stats["agent_generate_calls"] > 0  # the sandboxed path, not the in-process one
        assert all(e.status == "ok" and e.num_turns == 2 for e in result.episodes), [e.error for e in result.episodes]
        _check_two_image_episodes(worker, result.episodes)
    finally:
        hosts.close()
