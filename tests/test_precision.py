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


def test_fp32_adapters_on_a_bf16_base_sample_from_a_bf16_copy_that_follows_every_write(tiny_model):
    """The short LoRA path (sampling/lora_inference.py) on a bf16 base: a bf16 copy of the fp32 adapter, equal to
    peft's own forward to bf16 rounding, and rebuilt after in-place writes (an optimizer step, a load)."""
    from tinkerless.functions.sampling import lora_inference
    from tinkerless.functions.worker import Worker

    worker = Worker(tiny_model, dtype="bf16")
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=2)))
    layer = next(m for m in worker.model.modules() if getattr(m, lora_inference._MARK, False))
    worker.model.set_adapter("p")
    x = torch.randn(3, 5, layer.base_layer.in_features, dtype=torch.bfloat16)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return layer(x), type(layer).forward(layer, x)

    with torch.no_grad():
        layer.lora_B["p"].weight.normal_()  # B starts at zero: give the adapter an effect to compare
    lean, peft = both()

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    assert lean.dtype == torch.bfloat16 and layer._tinkerless_views["p"].copied
    assert relative(lean, peft) < 0.01  # bf16 rounding of the adapter's product, not another result
    with torch.no_grad():
        layer.lora_A["p"].weight.mul_(3.0)  # an in-place write, as an optimizer step makes
    after, peft_after = both()
    assert relative(after, lean) > 0.1  # the copy was rebuilt, not stale
    assert relative(after, peft_after) < 0.01


def test_after_an_update_a_bf16_worker_samples_from_the_new_weights(tiny_model):
    """The sampler's recorded log-probs after optimizer steps are the updated policy's (the trainer's, to bf16
    rounding), not the weights before the steps: a stale bf16 copy would record those."""
    from tinkerless.functions.losses import LossConfig
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import AdamParams, SamplingParams, UpdateRequest

    worker = Worker(tiny_model, dtype="bf16")
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=8, seed=5)))
    prompt = [5, 6, 7, 8]
    # a first sample builds the bf16 copies of the adapter (what a stale copy would keep sampling from)
    worker.engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[]), policy="p", seed=7)
    tokens = np.arange(5, 25, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    for _ in range(5):  # large steps: the policy moves away from where it started
        worker.update(UpdateRequest("p", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)],
                                    LossConfig(), AdamParams(learning_rate=0.5)))
    [after] = worker.engine.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[]), policy="p", seed=7)
    sampled = np.array(prompt + list(after.tokens), np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(after.tokens))].astype(np.float32)

    def scored(policy: str) -> np.ndarray:
        return worker.forward(ForwardRequest(policy, [Datum(sampled, mask)])).logprobs[0][len(prompt):]

    recorded = np.asarray(after.logprobs)
    to_trainer = np.abs(recorded - scored("p")).mean()
    to_base = np.abs(recorded - scored("base")).mean()  # the adapter started at zero: "before" is the base
    assert to_trainer < 0.25 * to_base, (to_trainer, to_base)
