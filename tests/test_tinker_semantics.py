"""Tinker semantics through the official SDK: the dro loss, CISPO's default clip, train_unembed,
seed=None, and the prompt-scoring sampling options checked against an independent forward pass."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-semantics")
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    worker = Worker(model)
    app = create_app(worker, storage=str(root / "storage"))
    with serve_in_thread(app) as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-no-auth-on-this-server")
        yield {"client": client, "worker": worker, "model": model, "service": app.state.tinker, "url": url}
        client.close(status="success")


def rl_datum(advantage: float, sampler_logprobs: list[float]) -> types.Datum:
    n = len(TOKENS) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "logprobs": sampler_logprobs, "advantages": [advantage] * n},
    )


def learner_logprobs(training) -> np.ndarray:
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    return training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def lora_tensors(server, training, module: str) -> dict[str, torch.Tensor]:
    """This run's LoRA tensors on `module`, read from the server's worker (same process)."""
    policy = server["service"].models[training.model_id].policy
    return {n: p.detach().clone() for n, p in server["worker"].model.named_parameters()
            if f".{policy}." in n and "lora_" in n and module in n}


@pytest.mark.parametrize("config, beta", [(None, 0.05), ({"beta": 0.7}, 0.7)])
def test_dro_loss_is_tinkers_definition(server, config, beta):
    training = server["client"].create_lora_training_client(base_model=server["model"], rank=4, seed=1).result()
    q = learner_logprobs(training) - 0.3  # the sampler was a little off the learner
    advantage = 1.5
    out = training.forward_backward([rl_datum(advantage, q.tolist())], "dro", loss_fn_config=config).result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    expected = -np.sum(lp * advantage - 0.5 * beta * (lp - q) ** 2)
    assert out.metrics["loss:sum"] == pytest.approx(float(expected), rel=1e-4)
    with pytest.raises(tinker.RequestFailedError, match="not supported for dro"):
        training.forward_backward([rl_datum(1.0, q.tolist())], "dro", loss_fn_config={"clip_low_threshold": 0.5}).result()


def test_cispo_clips_the_ratio_at_four_by_default(server):
    training = server["client"].create_lora_training_client(base_model=server["model"], rank=4, seed=1).result()
    lp = learner_logprobs(training)
    q = lp - np.log(10.0)  # ratio 10: above the default upper clip of 4
    out = training.forward_backward([rl_datum(1.0, q.tolist())], "cispo").result()
    assert out.metrics["loss:sum"] == pytest.approx(float(-np.sum(4.0 * lp)), rel=1e-4)
    q = lp + np.log(10.0)  # ratio 0.1: no lower clip by default (clip_low_threshold 0)
    out = training.forward_backward([rl_datum(1.0, q.tolist())], "cispo").result()
    assert out.metrics["loss:sum"] == pytest.approx(float(-np.sum(0.1 * lp)), rel=1e-3)


@pytest.mark.parametrize("train_unembed", [True, False])
def test_train_unembed_trains_the_output_layer(server, train_unembed):
    training = server["client"].create_lora_training_client(
        base_model=server["model"], rank=4, seed=2, train_unembed=train_unembed).result()
    before = lora_tensors(server, training, "lm_head")
    assert bool(before) == train_unembed
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)})
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = lora_tensors(server, training, "lm_head")
    assert after.keys() == before.keys()
    if train_unembed:
        assert all(not torch.equal(before[k], after[k]) for k in before if "lora_B" in k)
    base_embedding = server["worker"].model.get_input_embeddings().weight
    assert not base_embedding.requires_grad  # the tied base matrix stays shared and frozen


def test_seed_none_is_random_and_a_seed_is_reproducible(server):
    def init(seed):
        training = server["client"].create_lora_training_client(base_model=server["model"], rank=4, seed=seed).result()
        return torch.cat([t.flatten() for t in lora_tensors(server, training, "q_proj").values()])

    assert not torch.equal(init(None), init(None))
    assert torch.equal(init(7), init(7))


@pytest.fixture(scope="module")
def reference(server):
    """Log-softmax of the base model over TOKENS, computed here with transformers, not by the server."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(server["model"]).eval()
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0, :-1].float().log_softmax(-1).numpy()


def sample(server, **options) -> types.SampleResponse:
    sampler = server["client"].create_sampling_client(base_model=server["model"]).result()
    return sampler.sample(types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=2, seed=5),
                          **options).result()


@pytest.fixture(params=[256, 3], ids=["one-chunk", "chunks-of-3"])
def row_chunk(request, monkeypatch):
    """The server scores prompt positions in row chunks; a chunk of 3 splits this prompt's 7 rows unevenly."""
    from tinkerless.server.tinker_api import prompt_scores

    monkeypatch.setattr(prompt_scores, "_ROW_CHUNK", request.param)
    return request.param


def test_prompt_logprobs_topk_and_last_n_match_a_forward_pass(server, reference, row_chunk):
    n = len(TOKENS)
    truth = reference[np.arange(n - 1), TOKENS[1:]]
    full = sample(server, include_prompt_logprobs=True, topk_prompt_logprobs=3)
    assert full.prompt_logprobs[0] is None
    np.testing.assert_allclose(full.prompt_logprobs[1:], truth, atol=1e-4)
    assert full.topk_prompt_logprobs[0] is None and len(full.topk_prompt_logprobs) == n
    for i, row in enumerate(full.topk_prompt_logprobs[1:]):
        best = np.argsort(-reference[i])[:3]
        assert [t for t, _ in row] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in row], reference[i][best], atol=1e-4)
    last = sample(server, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3)
    assert last.prompt_logprobs[:-3] == [None] * (n - 3)
    np.testing.assert_allclose(last.prompt_logprobs[-3:], truth[-3:], atol=1e-4)
    assert last.topk_prompt_logprobs[:-3] == [None] * (n - 3) and all(last.topk_prompt_logprobs[-3:])


def test_target_prompt_logprobs_dense_and_sparse(server, reference, row_chunk):
    n = len(TOKENS)
    targets = np.full((n - 1, 2), -1, np.int64)
    targets[:, 0] = TOKENS[1:]
    targets[::2, 1] = 40
    out = sample(server, target_prompt_logprobs=types.TensorData.from_numpy(targets)).target_prompt_logprobs.to_numpy()
    assert out.shape == (n - 1, 2)
    np.testing.assert_allclose(out[:, 0], reference[np.arange(n - 1), TOKENS[1:]], atol=1e-4)
    np.testing.assert_allclose(out[::2, 1], reference[::2, 40], atol=1e-4)
    assert np.all(out[1::2, 1] == 0.0)  # a -1 cell asks nothing and gets 0.0
    # Sparse CSR: only the listed cells are asked; the answer has the same layout.
    crow = [0] + list(np.cumsum([1 if i % 3 == 0 else 0 for i in range(n - 1)]))
    rows = [i for i in range(n - 1) if i % 3 == 0]
    sparse = types.TensorData(data=[77] * len(rows), dtype="int64", shape=[n - 1, 4],
                              sparse_crow_indices=[int(c) for c in crow], sparse_col_indices=[2] * len(rows))
    answer = sample(server, target_prompt_logprobs=sparse).target_prompt_logprobs
    assert answer.sparse_crow_indices == sparse.sparse_crow_indices
    np.testing.assert_allclose(answer.data, reference[rows, 77], atol=1e-4)


def test_prompt_alt_tokens_are_seeded_draws_with_true_logprobs(server, reference, row_chunk):
    first = sample(server, prompt_alt_tokens_k=4).prompt_alt_tokens
    tokens, logprobs = first.tokens.to_numpy(), first.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(TOKENS) - 1, 4)
    np.testing.assert_allclose(logprobs, np.take_along_axis(reference, tokens, axis=1), atol=1e-4)
    again = sample(server, prompt_alt_tokens_k=4).prompt_alt_tokens.tokens.to_numpy()
    assert np.array_equal(tokens, again)  # same seed, same draws


@pytest.mark.parametrize("options, message", [
    ({"prompt_logprobs_last_n": 3}, "needs prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 8}, "out of range"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 2.5}, "must be an integer"),
    ({"target_prompt_logprobs": {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]}}, "rows"),
    ({"target_prompt_logprobs": {"data": [10**6] * 7, "dtype": "int64", "shape": [7, 1]}}, "outside"),
    ({"target_prompt_logprobs": {"data": [1.5] * 7, "dtype": "float32", "shape": [7, 1]}}, "int64"),
    ({"target_prompt_logprobs": {"data": [1] * 6, "dtype": "int64", "shape": [7, 1]}}, "values for shape"),
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [7, 2], "sparse_crow_indices": [0, 1],
                                 "sparse_col_indices": [0]}}, "inconsistent CSR"),
    ({"target_prompt_logprobs": [1, 2]}, "TensorData"),
    ({"topk_prompt_logprobs": 100000}, "out of range"),
    ({"topk_prompt_logprobs": -1}, "out of range"),
    ({"prompt_alt_tokens_k": "4"}, "must be an integer"),
    ({"topk_sample_logprobs": 2}, "not supported"),
])
def test_bad_prompt_options_are_user_errors(server, options, message):
    """Sent raw, as a client that skips the SDK's own checks would: the server refuses each with a 400."""
    import httpx

    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}, "num_samples": 1,
            "sampling_params": {"max_tokens": 2}, "base_model": server["model"], **options}
    response = httpx.post(server["url"] + "/api/v1/asample", json=body, headers={"X-API-Key": "tml-x"})
    assert response.status_code == 400, response.text
    assert response.json()["category"] == "user" and message in response.json()["error"]
