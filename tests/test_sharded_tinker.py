"""The official `tinker` SDK cannot tell two ranks from one (issue #27): the same calls against a server whose
update runs on one process and against `serve --gpus 2`'s split (a sampler here, two gloo ranks under FSDP2)
give the same losses, log-probs, samples and checkpoints, and a state saved by the ranks restores with its
optimizer and trains on as the one process does."""

from __future__ import annotations

import os

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from test_tinker_api import sequence_datum  # noqa: E402  (a cookbook-style SFT datum)
from tinker import types  # noqa: E402

from tinkerless.functions.sharding.split import SplitWorker  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"
ADAM = types.AdamParams(learning_rate=1e-2)
PROBE = [5, 9, 14, 20, 27, 35, 44]
BATCH = [
    sequence_datum([3, 4, 5, 6, 7, 8], [0, 0, 1, 1, 1]),
    sequence_datum([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]),
    sequence_datum([30, 31, 32], [1, 1]),
]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """Two servers on the same tiny model: one Worker, and a SplitWorker over two CPU ranks."""
    one = Worker(tiny_model, micro_batch_size=2)
    two = SplitWorker(tiny_model, ranks=2, micro_batch_size=2)
    root = tmp_path_factory.mktemp("sharded-tinker")
    try:
        with serve_in_thread(create_app(one, storage=str(root / "one"))) as url_one, \
             serve_in_thread(create_app(two, storage=str(root / "two"))) as url_two:  # fmt: skip
            clients = [tinker.ServiceClient(base_url=url, api_key="tml-no-auth-on-this-server") for url in (url_one, url_two)]
            yield clients
            for client in clients:
                client.close(status="success")
    finally:
        two.close()


def logprobs(training) -> np.ndarray:
    datum = sequence_datum(PROBE, [1.0] * (len(PROBE) - 1))
    return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def step(training) -> tuple[float, list[np.ndarray]]:
    out = training.forward_backward(BATCH, "cross_entropy").result()
    training.optim_step(ADAM).result()
    return out.metrics["loss:sum"], [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def test_the_sdk_gets_the_same_answers_from_two_ranks_as_from_one(servers, tiny_model):
    runs = [client.create_lora_training_client(base_model=tiny_model, rank=4, seed=7).result() for client in servers]
    base = [logprobs(t) for t in runs]
    np.testing.assert_allclose(base[1], base[0], atol=1e-5)
    for _ in range(2):
        (loss_one, lp_one), (loss_two, lp_two) = (step(t) for t in runs)
        assert loss_two == pytest.approx(loss_one, rel=1e-5)
        for ours, theirs in zip(lp_two, lp_one):
            np.testing.assert_allclose(ours, theirs, atol=1e-5)
    after = [logprobs(t) for t in runs]
    np.testing.assert_allclose(after[1], after[0], atol=1e-5)
    assert not np.allclose(after[0], base[0], atol=1e-4)  # the steps moved the policy

    # The sampler beside the ranks holds their newest version: the same tokens for the same seed.
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    prompt = types.ModelInput.from_ints([9, 8, 7])
    samples = [t.save_weights_and_get_sampling_client().result().sample(prompt, 3, params).result() for t in runs]
    assert [list(s.tokens) for s in samples[1].sequences] == [list(s.tokens) for s in samples[0].sequences]

    # A state saved by the ranks restores there with its optimizer and trains on as the one process does.
    saved = [t.save_state("mid").result().path for t in runs]
    restored = [client.create_training_client_from_state_with_optimizer(path).result()
                for client, path in zip(servers, saved)]  # fmt: skip
    np.testing.assert_allclose(logprobs(restored[1]), after[0], atol=1e-5)
    (loss_one, _), (loss_two, _) = (step(t) for t in restored)
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    np.testing.assert_allclose(logprobs(restored[1]), logprobs(restored[0]), atol=1e-5)
