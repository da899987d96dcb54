"""The official `tinker` SDK against `tinkerless serve --model smollm2`: the real model answers and trains."""

from __future__ import annotations

import os

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinkerless.functions.models import resolve_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402

pytestmark = pytest.mark.slow
os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    worker = Worker("smollm2")
    app = create_app(worker, storage=str(tmp_path_factory.mktemp("srv")))
    with serve_in_thread(app) as url:
        client = tinker.ServiceClient(base_url=url, api_key="tml-no-auth-on-this-server")
        yield client, worker, resolve_model("smollm2")
        client.close(status="success")


def chat_prompt(worker, question: str) -> list[int]:
    return worker.chat.prompt_tokens([{"role": "user", "content": question}])


def test_smollm2_answers_through_the_sdk(smollm2):
    client, worker, model_path = smollm2
    sampler = client.create_sampling_client(base_model=model_path).result()
    prompt = types.ModelInput.from_ints(chat_prompt(worker, "What is 7 + 5? Answer with a number."))
    result = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0)).result()
    text = worker.tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)
    assert "12" in text


def test_smollm2_sft_and_rl_steps_through_the_sdk(smollm2):
    client, worker, model_path = smollm2
    training = client.create_lora_training_client(base_model=model_path, rank=8).result()
    # SFT: teach the answer format on one example; the loss on it falls.
    prompt = chat_prompt(worker, "What is 2 + 2?")
    answer = worker.tokenizer.encode("The answer is 4.", add_special_tokens=False)
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    losses = []
    for _ in range(3):
        fwd_bwd = training.forward_backward([datum], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        losses.append(fwd_bwd.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    # RL: sample from the trained weights, score, and take an importance-sampling step.
    sampler = training.save_weights_and_get_sampling_client().result()
    question = chat_prompt(worker, "What is 3 + 4? Answer with a number.")
    samples = sampler.sample(types.ModelInput.from_ints(question), 4, types.SamplingParams(max_tokens=8, temperature=0.7, seed=0)).result().sequences
    rewards = [float("7" in worker.tokenizer.decode(s.tokens)) for s in samples]
    mean = sum(rewards) / len(rewards)
    data = []
    for sample, reward in zip(samples, rewards):
        full = question + list(sample.tokens)
        n = len(question) - 1
        data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:], "logprobs": [0.0] * n + list(sample.logprobs),
            "advantages": [0.0] * n + [reward - mean] * len(sample.tokens)}))
    out = training.forward_backward(data, "importance_sampling").result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    # On-policy the ratio is 1 (sampler and learner agree), so the loss is -sum of advantage x tokens.
    expected = -sum((r - mean) * len(s.tokens) for s, r in zip(samples, rewards))
    scale = sum(abs(r - mean) * len(s.tokens) for s, r in zip(samples, rewards))
    assert abs(out.metrics["loss:sum"] - expected) <= 0.05 * scale + 1e-4
    assert [len(o["logprobs"].to_numpy()) for o in out.loss_fn_outputs] == [len(d.model_input.to_ints()) for d in data]
