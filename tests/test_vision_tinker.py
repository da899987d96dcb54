"""The official `tinker` SDK's `ImageChunk` through `tinkerless serve` on a tiny LLaVA-style model: a datum with an
image trains (its image tokens never do), a sampler samples from a prompt with an image, and a hostile image
chunk is a 4xx."""

from __future__ import annotations

import io
import os
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"


def _png(shade: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.full((24, 20, 3), shade, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tinkerless.functions.vision.models import build_tiny_llava
    from tinkerless.functions.worker import Worker
    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore

    root = tmp_path_factory.mktemp("tinker-vision")
    model = build_tiny_llava(root / "llava", initializer_range=0.2)
    keys = KeyStore(ObjectStore(str(root / "storage")))
    worker = Worker(model)
    with serve_in_thread(create_app(worker, keys=keys, storage=str(root / "storage"))) as url:
        client = tinker.ServiceClient(base_url=url, api_key=keys.create("alice"))
        yield client, model, worker
        client.close(status="success")


def _datum(worker, shade: int, answer: str) -> types.Datum:
    """inputs = seq[:-1], targets = seq[1:]; the image chunk stands for its 16 image tokens."""
    encode = worker.chat.encode
    before, after = encode("<|im_start|>user\n"), encode("which shade?<|im_end|>\n<|im_start|>assistant\n")
    reply = encode(answer) + [worker.chat.end_of_turn_id]
    image_tokens = [worker.vision.processor.image_token_id] * 16
    seq = before + image_tokens + after + reply
    weights = [0.0] * (len(before) + 16 + len(after) - 1) + [1.0] * len(reply)
    chunks = [types.EncodedTextChunk(tokens=before), types.ImageChunk(data=_png(shade), format="png", expected_tokens=16),
              types.EncodedTextChunk(tokens=(after + reply)[:-1])]
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": weights})


def test_image_chunks_train_and_sample_through_the_tinker_sdk(served):
    client, model, worker = served
    training = client.create_lora_training_client(base_model=model, rank=8).result()
    data = [_datum(worker, 20, "dark"), _datum(worker, 230, "light")]
    losses = []
    for _ in range(4):
        out = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["loss:sum"])
        image_positions = [i for i, t in enumerate(data[0].loss_fn_inputs["target_tokens"].tolist())
                           if t == worker.vision.processor.image_token_id]
        assert (out.loss_fn_outputs[0]["logprobs"].to_numpy()[image_positions] == 0).all()  # never trained
    assert losses[-1] < losses[0] * 0.8, losses
    sampler = training.save_weights_and_get_sampling_client("v1").result() if hasattr(
        training, "save_weights_and_get_sampling_client") else training.save_weights_and_get_sampling_client_sync("v1")
    prompt = types.ModelInput(chunks=data[1].model_input.chunks[:2] + [types.EncodedTextChunk(
        tokens=worker.chat.encode("which shade?<|im_end|>\n<|im_start|>assistant\n"))])
    result = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(result.sequences) == 2 and result.sequences[0].tokens == result.sequences[1].tokens
    assert worker.vision.processor.image_token_id not in result.sequences[0].tokens


def test_a_hostile_image_chunk_is_a_user_error(served):
    client, model, worker = served
    training = client.create_lora_training_client(base_model=model, rank=4).result()
    for data, expected in ((_png(9)[:-20], 16), (_png(9)[:-5], 16), (b"not an image", 16), (_png(9), 5)):
        datum = _datum(worker, 9, "x")
        datum.model_input.chunks[1] = types.ImageChunk(data=data, format="png", expected_tokens=expected)
        with pytest.raises(Exception) as refused:
            training.forward_backward([datum], "cross_entropy").result()

        assert "400" in str(refused.value) or "image" in str(refused.value).lower(), refused.value
    # The refused calls used up their places in the model's order: the next call runs at once, not after a wait.
    started = time.perf_counter()
    assert training.forward_backward([_datum(worker, 9, "x")], "cross_entropy").result().metrics
    assert time.perf_counter() - started < 10
