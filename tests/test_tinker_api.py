"""The official `tinker` SDK (0.38), unmodified, against `tinkerless serve` on loopback.

Loops are written the way tinker-cookbook's `sl_loop` and `rl_loop` recipes use the
SDK: pipelined forward_backward + optim_step futures, a fresh sampling client per
RL step, checkpoints by `tinker://` path. A tiny random model keeps them fast; it is
built with a wider init than the shared fixture's so that training visibly moves it
(at the default init its logits stay within about +-1.3).
"""

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
from tinkerless.storage import CheckpointStore, ObjectStore  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-server")
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    keys = KeyStore(ObjectStore(str(root / "storage")))
    alice, bob = keys.create("alice"), keys.create("bob")
    app = create_app(Worker(model), keys=keys, storage=str(root / "storage"))
    with serve_in_thread(app) as url:
        yield {"url": url, "alice": alice, "bob": bob, "root": root / "storage", "model": model}


@pytest.fixture
def service(server):
    client = tinker.ServiceClient(base_url=server["url"], api_key=server["alice"])
    yield client
    client.close(status="success")


def sequence_datum(tokens: list[int], weights: list[float]) -> types.Datum:
    """A cookbook-style SFT datum: inputs = seq[:-1], targets = seq[1:], one weight per target."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


SFT_DATA = [
    sequence_datum([5, 6, 7, 8, 9, 10, 11, 12], [0, 0, 0, 1, 1, 1, 1]),
    sequence_datum([20, 21, 22, 23, 24, 25], [0, 0, 1, 1, 1]),
]


def nll(output: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    total = sum(-np.dot(o["logprobs"].to_numpy(), d.loss_fn_inputs["weights"].to_numpy()) for o, d in zip(output.loss_fn_outputs, data))
    return float(total)


def test_sl_loop_trains_and_reports_tinker_metrics(service, server):
    training = service.create_lora_training_client(base_model=server["model"], rank=8).result()
    losses = []
    for _ in range(8):
        # Submitted back to back before waiting, as sl_loop pipelines them: the server keeps seq_id order.
        fwd_bwd = training.forward_backward(SFT_DATA, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
        out = fwd_bwd.result()
        optim.result()
        assert all(key.count(":") == 1 for key in out.metrics)
        # Tinker's cross_entropy is a weighted sum: loss:sum is -sum(w * logprob) over the returned logprobs.
        assert out.metrics["loss:sum"] == pytest.approx(nll(out, SFT_DATA), rel=1e-4)
        assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[7], [5]]
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0]


def test_logprobs_are_aligned_with_the_targets(service, server):
    """The server's per-target logprobs equal log_softmax of the model itself at the position before each target."""
    import torch
    from transformers import AutoModelForCausalLM

    training = service.create_lora_training_client(base_model=server["model"], rank=8).result()
    tokens = [5, 9, 13, 17, 21, 25]
    out = training.forward([sequence_datum(tokens, [1.0] * 5)], "cross_entropy").result()
    model = AutoModelForCausalLM.from_pretrained(server["model"]).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(tokens[1:])]
    # A fresh LoRA adapter starts as the identity (B = 0), so it scores like the base model.
    np.testing.assert_allclose(out.loss_fn_outputs[0]["logprobs"].to_numpy(), expected.numpy(), atol=1e-4)


def rl_datum(prompt: list[int], sample: types.SampledSequence, advantage: float) -> types.Datum:
    tokens = prompt + list(sample.tokens)
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n_prompt + list(sample.logprobs),
            "advantages": [0.0] * n_prompt + [advantage] * len(sample.tokens),
        },
    )


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo"])
def test_rl_loop_raises_the_reward(service, server, loss_fn):
    training = service.create_lora_training_client(base_model=server["model"], rank=8, seed=1).result()
    prompt = [7, 8, 9]

    def reward(sample) -> float:  # the share of even token ids: about 0.5 at the start, a dense signal
        return sum(t % 2 == 0 for t in sample.tokens) / len(sample.tokens)

    rewards = []
    for step in range(10):
        params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[], seed=step)
        sampler = training.save_weights_and_get_sampling_client().result()
        samples = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=16, sampling_params=params).result().sequences
        assert len({s.sequence_id for s in samples}) == 16
        group = [reward(s) for s in samples]
        rewards.append(np.mean(group))
        advantages = np.array(group) - np.mean(group)
        data = [rl_datum(prompt, s, float(a)) for s, a in zip(samples, advantages)]
        fwd_bwd = training.forward_backward(data, loss_fn)
        optim = training.optim_step(types.AdamParams(learning_rate=0.01))
        assert "loss:sum" in fwd_bwd.result().metrics
        optim.result()
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15


def test_sampling_returns_logprobs_and_prompt_logprobs(service, server):
    sampler = service.create_sampling_client(base_model=server["model"]).result()
    prompt = types.ModelInput.from_ints([3, 4, 5, 6])
    params = types.SamplingParams(max_tokens=6, temperature=0.7, seed=11)
    first = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    again = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
    assert [list(s.tokens) for s in first.sequences] == [list(s.tokens) for s in again.sequences]  # seeded
    for seq in first.sequences:
        assert seq.stop_reason in ("stop", "length") and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)
    prompt_logprobs = sampler.compute_logprobs(prompt).result()
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == 4 and all(lp < 0 for lp in prompt_logprobs[1:])


def test_a_temperature_near_zero_samples_greedily(service, server):
    """Not a 500: dividing the logits by 1e-300 would overflow them and draw outside the vocabulary."""
    sampler = service.create_sampling_client(base_model=server["model"]).result()
    prompt = types.ModelInput.from_ints([3, 4, 5])
    greedy = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[], seed=1),
                            prompt_alt_tokens_k=2).result()
    for temperature in (1e-300, 5e-324, 1e-5):
        params = types.SamplingParams(max_tokens=6, temperature=temperature, stop=[], seed=2)
        near_zero = sampler.sample(prompt, 2, sampling_params=params, prompt_alt_tokens_k=2).result()
        assert near_zero.prompt_alt_tokens.tokens.to_numpy().tolist() == greedy.prompt_alt_tokens.tokens.to_numpy().tolist()
        for seq, want in zip(near_zero.sequences, greedy.sequences):
            assert list(seq.tokens) == list(want.tokens) and len(seq.tokens) == 6
            assert list(seq.logprobs) == pytest.approx(list(want.logprobs), abs=1e-5)


def test_stop_token_ends_a_sample(service, server):
    sampler = service.create_sampling_client(base_model=server["model"]).result()
    prompt = types.ModelInput.from_ints([3, 4, 5])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=3, stop=[])).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 8
    stop_at = int(free.tokens[2])
    cut = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, seed=3, stop=[stop_at])).result().sequences[0]
    first = list(free.tokens).index(stop_at)
    assert cut.stop_reason == "stop" and list(cut.tokens) == list(free.tokens[: first + 1])


def test_checkpoints_round_trip_with_optimizer_state(service, server):
    training = service.create_lora_training_client(base_model=server["model"], rank=8).result()
    for _ in range(2):
        training.forward_backward(SFT_DATA, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    saved = training.save_state("round-trip").result().path
    assert saved.startswith("tinker://") and saved.endswith("/weights/round-trip")
    restored = service.create_training_client_from_state_with_optimizer(saved).result()
    probe = [sequence_datum([30, 31, 32, 33, 34], [1, 1, 1, 1])]
    before = [t.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for t in (training, restored)]
    np.testing.assert_array_equal(before[0], before[1])
    # Same data, same optimizer moments: the next step lands both on the same weights.
    for client in (training, restored):
        client.forward_backward(SFT_DATA, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = [t.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for t in (training, restored)]
    np.testing.assert_allclose(after[0], after[1], atol=1e-6)
    assert not np.allclose(after[0], before[0])

    # Sampler weights by name: a sampling client on the path samples like the training adapter.
    sampler_path = training.save_weights_for_sampler("for-sampling").result().path
    assert sampler_path.endswith("/sampler_weights/for-sampling")
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=5)
    prompt = types.ModelInput.from_ints([9, 8, 7])
    by_path = service.create_sampling_client(model_path=sampler_path).result().sample(prompt, 2, params).result()
    live = training.save_weights_and_get_sampling_client().result().sample(prompt, 2, params).result()
    assert [list(s.tokens) for s in by_path.sequences] == [list(s.tokens) for s in live.sequences]

    # Listing and deletion through the REST client.
    rest = tinker.RestClient(base_url=server["url"], api_key=server["alice"])
    run_id = saved.split("/")[2]
    ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert {"weights/round-trip", "sampler_weights/for-sampling"} <= ids
    assert rest.get_training_run(run_id).result().lora_rank == 8
    rest.delete_checkpoint(run_id, "weights/round-trip").result()
    ids = {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert "weights/round-trip" not in ids
    # Stored under the tenant's own prefix.
    assert any(p.startswith("tenants/alice/tinker/runs/") for p in ObjectStore(str(server["root"])).list("tenants"))


def test_an_unknown_loss_is_a_clean_user_error(service, server):
    training = service.create_lora_training_client(base_model=server["model"], rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="unsupported loss_fn 'gspo'"):
        training.forward_backward(SFT_DATA, "gspo").result(timeout=60)


def test_a_bad_base_model_is_a_clean_user_error(service):
    with pytest.raises(tinker.BadRequestError, match="this server serves"):
        service.create_lora_training_client(base_model="meta-llama/Llama-3.2-1B", rank=4).result()


def test_a_wrong_api_key_is_refused(server):
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server["url"], api_key="tml-not-a-key").create_lora_training_client(
            base_model=server["model"], rank=4
        ).result()


def test_tenants_cannot_see_or_use_each_others_runs(service, server):
    training = service.create_lora_training_client(base_model=server["model"], rank=4).result()
    path = training.save_state("private").result().path
    run_id = path.split("/")[2]
    bob = tinker.ServiceClient(base_url=server["url"], api_key=server["bob"])
    bob_rest = tinker.RestClient(base_url=server["url"], api_key=server["bob"])
    with pytest.raises(tinker.NotFoundError):
        bob_rest.get_training_run(run_id).result()
    with pytest.raises(tinker.NotFoundError):
        bob_rest.list_checkpoints(run_id).result()
    assert run_id not in {r.training_run_id for r in bob_rest.list_training_runs().result().training_runs}
    with pytest.raises(tinker.TinkerError, match="no checkpoint"):
        bob.create_training_client_from_state(path).result()
    headers = {"X-API-Key": server["bob"]}
    # Naming alice's model directly fails as if it did not exist.
    reply = httpx.post(f"{server['url']}/api/v1/get_info", json={"model_id": run_id, "type": "get_info"}, headers=headers)
    assert reply.status_code == 400 and "unknown model" in reply.json()["error"]
    bob.close(status="success")


def test_calls_run_in_seq_id_order_even_when_they_arrive_out_of_order(service, server):
    """optim_step (seq 2) posted before forward_backward (seq 1) still runs second: it finds the gradients."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    training = service.create_lora_training_client(base_model=server["model"], rank=4).result()
    model_id = training.model_id
    headers = {"X-API-Key": server["alice"]}
    url = server["url"] + "/api/v1"
    optim = httpx.post(f"{url}/optim_step", headers=headers, json={
        "model_id": model_id, "seq_id": 2, "type": "optim_step", "adam_params": {"learning_rate": 1e-3}})
    request = types.ForwardBackwardRequest(
        model_id=model_id, seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(data=SFT_DATA, loss_fn="cross_entropy"),
    )
    body = forward_backward_request_to_proto(request).SerializeToString()
    fwd = httpx.post(f"{url}/forward_backward", headers={**headers, "Content-Type": "application/x-protobuf"}, content=body)

    def result(reply):
        return httpx.post(f"{url}/retrieve_future", headers=headers, json={"request_id": reply.json()["request_id"]}, timeout=60)

    assert result(fwd).status_code == 200
    assert result(optim).json()["metrics"]["grad_norm:mean"] > 0  # gradients were there: seq 1 ran first


def test_an_oversized_request_gets_413(tiny_model, tmp_path):
    app = create_app(Worker(tiny_model), storage=str(tmp_path), max_request_bytes=1000)
    with serve_in_thread(app) as url:
        reply = httpx.post(f"{url}/api/v1/forward_backward", content=b"x" * 5000)
    assert reply.status_code == 413 and "limit" in reply.json()["error"]


def test_unsupported_sampling_options_and_optimizers_are_refused_clearly(service, server):
    sampler = service.create_sampling_client(base_model=server["model"]).result()
    with pytest.raises(tinker.TinkerError, match="not supported"):
        sampler.sample(types.ModelInput.from_ints([3, 4]), 1, types.SamplingParams(max_tokens=2), include_prompt_logprobs=True,
                       topk_sample_logprobs=2).result(timeout=60)


def test_saving_over_a_name_replaces_it_and_a_corrupt_checkpoint_is_refused(service, server):
    training = service.create_lora_training_client(base_model=server["model"], rank=4).result()
    first = training.save_state("again").result().path
    training.forward_backward(SFT_DATA, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert training.save_state("again").result().path == first  # the same name, now the newer weights
    probe = [sequence_datum([30, 31, 32, 33], [1, 1, 1])]
    expected = training.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    restored = service.create_training_client_from_state(first).result()
    np.testing.assert_array_equal(restored.forward(probe, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy(), expected)
    # Damage the stored adapter: loading it is refused by its checksum, not silently used.
    store = ObjectStore(str(server["root"]))
    run_dir = first.split("/")[2].replace(":", "%3A")
    committed = CheckpointStore(store, f"tenants/alice/tinker/runs/{run_dir}/weights/again").location(1)
    (adapter,) = [k for k in store.list(committed) if k.endswith(".safetensors")]
    store.put(adapter, b"not an adapter")
    with pytest.raises(tinker.TinkerError, match="does not match its manifest"):
        service.create_training_client_from_state(first).result()
