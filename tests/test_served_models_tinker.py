"""The official `tinker` SDK against a `tinkerless serve` that holds an extra base model: a sampling client built
on it (`create_sampling_client(base_model=ID)`, how tinker-cookbook's distillation builds its teacher) samples and
computes prompt log-probs on that model, not the main one; the server lists it as sampleable and not trainable,
refuses a training client on it, and counts its calls under its id in the key's usage."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402
from tinkerless.wire.messages import BASE_POLICY, Datum, ForwardRequest  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model, worker):
    root = tmp_path_factory.mktemp("tinker-extra")
    teacher = build_tiny_model(root / "teacher", hidden_size=64, num_layers=2, seed=1, initializer_range=0.2)
    teacher_worker = Worker(teacher)
    keys = KeyStore(ObjectStore(str(root / "storage")))
    key = keys.create("lab")
    app = create_app(worker, keys=keys, storage=str(root / "storage"), price_per_hour=3600.0,
                     models={teacher: teacher_worker})
    with serve_in_thread(app) as url:
        client = tinker.ServiceClient(base_url=url, api_key=key)
        yield dict(url=url, key=key, teacher=teacher, teacher_worker=teacher_worker, main=tiny_model, service=client)
        client.close(status="success")


def _forward(worker, tokens: list[int]) -> np.ndarray:
    data = [Datum(tokens=np.asarray(tokens, np.int32), mask=np.zeros(len(tokens), np.float32))]
    return worker.forward(ForwardRequest(BASE_POLICY, data)).logprobs[0]


def test_a_sampling_client_on_an_extra_model_samples_and_scores_on_it(server, worker):
    service, teacher = server["service"], server["teacher"]
    before = httpx.get(f"{server['url']}/v1/usage", headers={"Authorization": f"Bearer {server['key']}"}).json()
    sampler = service.create_sampling_client(base_model=teacher).result()
    for tokens in ([3, 4, 5, 6], [10, 200, 7, 7, 7, 9, 30]):
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        expected = _forward(server["teacher_worker"], tokens)
        assert scored[0] is None
        np.testing.assert_allclose(scored[1:], expected[1:], atol=1e-5)  # the teacher's numbers...
        assert np.abs(expected[1:] - _forward(worker, tokens)[1:]).max() > 1e-3  # ...which are not the main model's
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=5, stop=[])
    sampled = sampler.sample(types.ModelInput.from_ints([3, 4, 5]), 2, params).result().sequences
    for sequence in sampled:  # each sampled token's log-prob is the teacher's own (temperature 1)
        full = [3, 4, 5, *sequence.tokens]
        np.testing.assert_allclose(sequence.logprobs, _forward(server["teacher_worker"], full)[3:], atol=1e-4)
    after = httpx.get(f"{server['url']}/v1/usage", headers={"Authorization": f"Bearer {server['key']}"}).json()
    was = before["models"].get(teacher, {"calls": 0})["calls"]
    assert after["models"][teacher]["calls"] - was == 3 and after["models"][teacher]["compute_seconds"] > 0


def test_the_extra_model_is_listed_sampleable_and_refused_for_training(server):
    service, teacher = server["service"], server["teacher"]
    models = {m.model_name: m for m in service.get_server_capabilities().supported_models}
    assert models[teacher].sampleable and not models[teacher].trainable
    assert models[server["main"]].trainable
    with pytest.raises(tinker.BadRequestError, match="sampling and log-probs only"):
        service.create_lora_training_client(base_model=teacher, rank=4).result()
