"""The worker's functions on the tiny model: updates, micro-batching, reference KL, PEFT-format state."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
    Datum,
    ForwardBackwardRequest,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    OptimStepRequest,
    SaveStateRequest,
    UpdateRequest,
)


def _sft_data(worker: Worker, texts: list[str]) -> list[Datum]:
    data = []
    for text in texts:
        prompt = worker.chat.prompt_tokens([{"role": "user", "content": "say it"}])
        answer = worker.chat.encode(text) + [worker.tokenizer.eos_token_id]
        tokens = np.array(prompt + answer, dtype=np.int32)
        mask = np.array([0] * len(prompt) + [1] * len(answer), dtype=np.float32)
        data.append(Datum(tokens=tokens, mask=mask))
    return data


@pytest.fixture()
def fresh_worker(tiny_model) -> Worker:
    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=8, seed=1)))
    return worker


def test_sft_updates_lower_the_loss(fresh_worker):
    data = _sft_data(fresh_worker, ["hello world", "tinkerless"])
    losses = [
        fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), AdamParams(learning_rate=1e-2))).metrics["loss"]
        for _ in range(8)
    ]
    assert losses[-1] < losses[0] * 0.9
    assert fresh_worker.policies["p"].version == 8


def test_micro_batching_does_not_change_the_gradient(tiny_model):
    grads = {}
    for micro in (1, 16):
        worker = Worker(tiny_model, micro_batch_size=micro)
        worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=3)))
        # Warm the adapter so B != 0 and every LoRA parameter gets a gradient.
        worker.update(UpdateRequest("p", _sft_data(worker, ["warm"]), LossConfig("cross_entropy"), AdamParams(learning_rate=1e-2)))
        data = _sft_data(worker, ["a", "bb cc", "ddd eee fff"])
        for datum, adv in zip(data, (1.0, -0.5, 2.0)):
            datum.advantages = datum.mask * adv
            datum.sampler_logprobs = np.zeros_like(datum.mask) - 1.0
        for normalization in ("token", "sequence"):
            loss = LossConfig("ppo", normalization=normalization)
            worker.forward_backward(ForwardBackwardRequest("p", data, loss))
            grads[(micro, normalization)] = [p.grad.clone() for p in worker.policies["p"].params]
            worker.policies["p"].optimizer.zero_grad(set_to_none=True)
    for normalization in ("token", "sequence"):
        for a, b in zip(grads[(1, normalization)], grads[(16, normalization)]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_reference_is_the_base_model_with_the_adapter_off(fresh_worker):
    data = _sft_data(fresh_worker, ["reference check"])
    before = fresh_worker.forward(ForwardRequest("p", data, with_reference=True))
    # A fresh LoRA adapter (B = 0) is the identity: policy == reference.
    np.testing.assert_allclose(before.logprobs[0], before.ref_logprobs[0], atol=1e-6)
    for _ in range(3):
        fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), AdamParams(learning_rate=1e-2)))
    after = fresh_worker.forward(ForwardRequest("p", data, with_reference=True))
    np.testing.assert_allclose(after.ref_logprobs[0], before.ref_logprobs[0], atol=1e-6)  # base untouched
    assert not np.allclose(after.logprobs[0], after.ref_logprobs[0], atol=1e-4)
    kl = fresh_worker.forward_backward(
        ForwardBackwardRequest(
            "p",
            [Datum(tokens=data[0].tokens, mask=data[0].mask, ref_logprobs=after.ref_logprobs[0])],
            LossConfig("cross_entropy", kl_coef=0.1),
        )
    ).metrics["kl"]
    assert kl > 0


def test_saved_state_is_a_standard_peft_adapter(fresh_worker, tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = _sft_data(fresh_worker, ["peft format"])
    fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), AdamParams(learning_rate=1e-2)))
    state = fresh_worker.save_state(SaveStateRequest("p"))
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "optimizer.pt"} <= set(state.files)
    adapter_dir = tmp_path / "adapter"
    adapter_dir.mkdir()
    for name, blob in state.files.items():
        if name.startswith("adapter/"):
            (adapter_dir / name.split("/", 1)[1]).write_bytes(blob)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), str(adapter_dir)).eval()
    ids = torch.tensor([data[0].tokens.tolist()], dtype=torch.long)
    with torch.no_grad():
        theirs = torch.log_softmax(peft_model(ids).logits[0, :-1].float(), -1)
        theirs = theirs.gather(1, ids[0, 1:, None]).squeeze(1).numpy()
    ours = fresh_worker.forward(ForwardRequest("p", data)).logprobs[0][1:]
    np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_load_state_restores_adapter_and_optimizer_exactly(fresh_worker, tiny_model):
    data = _sft_data(fresh_worker, ["restore me"])
    adam = AdamParams(learning_rate=1e-2)
    for _ in range(2):
        fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), adam))
    state = fresh_worker.save_state(SaveStateRequest("p"))

    other = Worker(tiny_model)
    other.load_state(LoadStateRequest(state))
    assert other.policies["p"].version == 2
    # The next step from restored state equals the next step of the original (Adam moments included).
    fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), adam))
    other.update(UpdateRequest("p", data, LossConfig("cross_entropy"), adam))
    for a, b in zip(fresh_worker.policies["p"].params, other.policies["p"].params):
        assert torch.equal(a, b)


def test_two_policies_share_one_base_model(fresh_worker):
    fresh_worker.create_policy(CreatePolicyRequest("q", LoraConfig(rank=8, seed=2)))
    data = _sft_data(fresh_worker, ["only p learns this"])
    q_before = [p.detach().clone() for p in fresh_worker.policies["q"].params]
    fresh_worker.update(UpdateRequest("p", data, LossConfig("cross_entropy"), AdamParams(learning_rate=1e-2)))
    assert all(torch.equal(a, b) for a, b in zip(q_before, fresh_worker.policies["q"].params))
    assert fresh_worker.policies["q"].version == 0 and fresh_worker.policies["p"].version == 1


def test_optim_step_clips_and_reports_grad_norm(fresh_worker):
    data = _sft_data(fresh_worker, ["clip"])
    fresh_worker.forward_backward(ForwardBackwardRequest("p", data, LossConfig("cross_entropy")))
    result = fresh_worker.optim_step(OptimStepRequest("p", AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3)))
    assert result.metrics["grad_norm"] > 1e-3
    assert all(p.grad is None for p in fresh_worker.policies["p"].params)


def test_engine_choice(tiny_model):
    from tinkerless.errors import ConfigError
    from tinkerless.functions.sampling.engine import TransformersEngine
    from tinkerless.functions.sampling.vllm_engine import vllm_available

    if not vllm_available():
        assert isinstance(Worker(tiny_model, engine="auto").engine, TransformersEngine)
        with pytest.raises(ConfigError, match="vllm"):
            Worker(tiny_model, engine="vllm")
    with pytest.raises(ConfigError, match="unknown engine"):
        Worker(tiny_model, engine="tensorrt")
