"""The precision policy (functions/precision.py) on a CPU: bf16 base weights with fp32 adapters and optimizer,
adapters that move between dtypes, and the sampler/trainer log-prob gap reported every step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tinkerless
from tinkerless.errors import ConfigError
from tinkerless.functions.precision import check_dtype, dtype_name, resolve_dtype
from tinkerless.sdk.run.metrics import read_metrics
from tinkerless.wire.messages import CreatePolicyRequest, Datum, ForwardRequest, LoadStateRequest, LoraConfig, \
    SaveStateRequest


def test_auto_is_fp32_on_a_cpu_and_names_are_checked():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16 and dtype_name(torch.bfloat16) == "bf16"
    for wrong in ("fp16", "float32", "BF16", None, 16):
        with pytest.raises(ConfigError, match="dtype"):
            check_dtype(wrong)
    with pytest.raises(ConfigError, match="dtype"):
        tinkerless.TrainConfig(model="tiny", dtype="fp16").validate()


def test_a_bf16_worker_keeps_adapters_and_optimizer_in_fp32(tiny_model):
    from tinkerless.functions.worker import Worker

    worker = Worker(tiny_model, dtype="bf16")
    assert worker.info()["dtype"] == "bf16"
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4)))
    base = [p for n, p in worker.model.named_parameters() if "lora_" not in n]
    lora = [p for n, p in worker.model.named_parameters() if "lora_" in n]
    assert {p.dtype for p in base} == {torch.bfloat16} and {p.dtype for p in lora} == {torch.float32}
    assert all(p.requires_grad for p in lora) and not any(p.requires_grad for p in base)


def _train(model: str, storage, dtype: str, steps: int = 3):
    return tinkerless.train(model=model, reward=lambda c, t: float(sum(map(ord, c)) % 2), tasks=[{"prompt": "hi"}],
                            steps=steps, batch_size=2, group_size=4, max_tokens=8, progress=False, storage=str(storage),
                            run_id=f"run-{dtype}", dtype=dtype, checkpoint_every=steps, seed=1)


@pytest.mark.parametrize("dtype, bound", [("fp32", 1e-4), ("bf16", 0.1)])
def test_every_step_reports_the_sampler_trainer_gap(tiny_model, tmp_path, dtype, bound):
    _train(tiny_model, tmp_path, dtype)
    records = read_metrics(tmp_path / "runs" / f"run-{dtype}" / "metrics.jsonl")
    trained = [r for r in records if r["trained_tokens"] > 0]
    assert trained, "no step trained"
    for record in trained:
        gap, kl = record["logprob_gap"], record["kl_sample_train"]
        assert math.isfinite(gap) and math.isfinite(kl) and 0 <= gap < bound and abs(kl) <= gap + 1e-9, record
    assert (tmp_path / "runs" / f"run-{dtype}" / "metrics.png").exists()


def test_an_adapter_trained_in_bf16_loads_in_fp32_and_back(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker

    bf16, fp32 = Worker(tiny_model, dtype="bf16"), Worker(tiny_model, dtype="fp32")
    bf16.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=3)))
    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.messages import AdamParams, UpdateRequest

    tokens = np.array([5, 6, 7, 8, 9, 10], np.int32)
    datum = Datum(tokens, np.array([0, 0, 1, 1, 1, 1], np.float32), advantages=np.ones(6, np.float32),
                  sampler_logprobs=-np.ones(6, np.float32))
    bf16.update(UpdateRequest("p", [datum], LossConfig(), AdamParams(learning_rate=1e-2)))
    state = bf16.save_state(SaveStateRequest("p"))
    fp32.load_state(LoadStateRequest(state))
    trained = {n: p for n, p in bf16.model.named_parameters() if "lora_" in n}
    loaded = {n: p for n, p in fp32.model.named_parameters() if "lora_" in n}
    assert trained.keys() == loaded.keys() and all(torch.equal(trained[n], loaded[n]) for n in trained)
    # The same adapter on either base: log-probs agree to bf16's rounding of the base weights.
    a = bf16.forward(ForwardRequest("p", [datum])).logprobs[0]
    b = fp32.forward(ForwardRequest("p", [datum])).logprobs[0]
    assert np.abs(a - b).max() < 0.1 and not np.array_equal(a, b)
    back = Worker(tiny_model, dtype="bf16")
    back.load_state(LoadStateRequest(fp32.save_state(SaveStateRequest("p"))))
    assert np.array_equal(back.forward(ForwardRequest("p", [datum])).logprobs[0], a)
