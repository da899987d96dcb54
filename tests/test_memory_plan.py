"""The memory planner (issue #27) against what was measured: peaks of the update and the sampler on an H200
(BENCHMARKS.md, bench/results/gpu.md) within 0.7x-1.5x, the bytes autograd saves for backward on the CPU, exact
parameter counts; refusals conservative (never of a configuration that was measured to fit) and naming the
smallest count or class that fits; docs/scaling.md's table generated from the planner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tinkerless.errors import ConfigError
from tinkerless.functions import memory_plan
from tinkerless.functions.memory_plan import (
    GIB,
    SHAPES,
    ModelShape,
    activation_bytes,
    check_fits,
    fits_update,
    sampler_memory,
    smallest_update,
    update_memory,
)
from tinkerless.functions.scaling_table import LADDER, largest_model_table

REPO = Path(__file__).resolve().parents[1]

# Measured on one H200 (141 GiB), bf16 base, LoRA r16 on all linear layers, 64 prompt + 128 new tokens a row
# (bench/results/gpu-h200-shapes-2026-11-26.jsonl): (shape, what, rows, tokens, trained tokens, peak GiB).
MEASURED = [
    ("1.7B", "update", 64, 192, 128, 19.4),
    ("1.7B", "sampling", 64, 192, None, 8.9),
    ("8B", "update", 16, 192, 128, 44.6),  # the activation budget large: no recompute
    ("8B", "sampling", 64, 192, None, 17.7),
    # bench/sharded_update.py's update on one H200 (bench/results/sharded-update-gpu-h200-2026-11-27-a.jsonl):
    # the Worker's peak; one rank of the sharded path measured the same.
    ("1.7B", "update", 64, 192, 128, 16.7),
    ("8B", "update", 16, 192, 128, 42.9),
]


def _estimate(shape: str, what: str, rows: int, tokens: int, trained: int | None, gpu_gib: float = 141.0) -> float:
    if what == "update":
        return update_memory(SHAPES[shape], rows=rows, tokens=tokens, trained_tokens=trained, gpu_gib=gpu_gib).gib
    return sampler_memory(SHAPES[shape], rows=rows, tokens=tokens).gib


@pytest.mark.parametrize("shape, what, rows, tokens, trained, peak", MEASURED, ids=lambda v: str(v))
def test_estimates_are_within_a_factor_of_the_measured_gpu_peaks(shape, what, rows, tokens, trained, peak):
    estimate = _estimate(shape, what, rows, tokens, trained)
    assert 0.7 <= estimate / peak <= 1.5, f"{shape} {what}: {estimate:.1f} GiB estimated, {peak} measured"


def test_an_rl_step_under_a_24_gib_cap_recomputes_and_fits_as_measured():
    """8B, 16 rows sampled to 512 tokens then trained under a 24 GiB cap: measured peak 15.4 GiB."""
    update = update_memory(SHAPES["8B"], rows=16, tokens=512, trained_tokens=448, gpu_gib=24)
    sampling = sampler_memory(SHAPES["8B"], rows=16, tokens=512)
    assert update.recompute and update.micro_rows == 1  # the worker cut it the same way
    assert 0.7 <= max(update.gib, sampling.gib) / 15.4 <= 1.5
    assert fits_update(SHAPES["8B"], "L4", 1)  # a 24 GB card: the planner does not refuse what ran
    assert smallest_update(SHAPES["8B"], gpus=1).gib <= 15.4


def test_refusals_are_never_of_a_measured_configuration():
    for shape, what, rows, tokens, trained, peak in MEASURED:
        if what == "update":
            assert smallest_update(SHAPES[shape], gpus=1, tokens=tokens).gib <= peak
            check_fits(SHAPES[shape], "H200", 1, role="update", model=shape)


def test_parameter_counts_are_exact(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=384, tie_word_embeddings=False)  # fmt: skip
    for model, shape in ((LlamaForCausalLM(config), ModelShape.from_config(config)),
                         (AutoModelForCausalLM.from_pretrained(tiny_model), ModelShape.of(tiny_model))):  # fmt: skip
        biases = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))  # Qwen2's q/k/v biases
        assert shape.params() == sum(p.numel() for p in model.parameters()) - biases
    assert ModelShape.of(tiny_model) == ModelShape.from_config(AutoConfig.from_pretrained(tiny_model))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_activations_match_the_bytes_autograd_saves_on_the_cpu(dtype):
    """What backward keeps (every saved tensor's storage, parameters aside) for a Llama with LoRA r16 on all
    linear layers, against the planner's per-token, per-layer figure."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                         num_key_value_heads=2, intermediate_size=768, tie_word_embeddings=True)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config).to(dtype), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    shape = ModelShape.from_config(config)
    assert sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) == shape.lora_params(16)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 512, (4, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    estimate = activation_bytes(shape, "bf16" if dtype == torch.bfloat16 else "fp32") * shape.layers * ids.numel()
    assert 0.7 <= estimate / sum(saved.values()) <= 1.5


def test_the_tiny_model_update_on_the_cpu_fits_its_estimate(tiny_model):
    """The whole update of the tiny model on the CPU: its tensors (weights, LoRA, gradients, moments) counted."""
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, Datum, LoraConfig, UpdateRequest
    from tinkerless.functions.losses import LossConfig
    import numpy as np

    worker = Worker(tiny_model)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=8, alpha=16)))
    tokens = np.arange(3, 67, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    worker.update(UpdateRequest("p", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)], LossConfig(),
                                AdamParams(learning_rate=1e-3)))  # fmt: skip
    policy = worker.policies["p"]
    held = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    held += sum(t.numel() * t.element_size() for s in policy.optimizer.state.values() for t in s.values() if t.dim())
    estimate = update_memory(ModelShape.of(tiny_model), dtype="fp32", lora_rank=8, rows=1, tokens=64)
    static = estimate.parts["weights"] + estimate.parts["lora states"]
    held += sum(p.numel() * 4 for p in policy.params)  # the gradients, freed by the step
    assert static == pytest.approx(held, rel=0.02)  # (Qwen2's q/k/v biases are not in the shape)


def test_sharding_divides_the_weights_and_lora_states():
    one, four = (update_memory(SHAPES["8B"], gpus=n, rows=4, tokens=512) for n in (1, 4))
    assert four.parts["lora states"] * 4 == pytest.approx(one.parts["lora states"], rel=1e-6)
    gathered = (2 * SHAPES["8B"].layer_params() + SHAPES["8B"].embedding_params()) * 2
    assert four.parts["weights"] == pytest.approx(one.parts["weights"] / 4 + gathered, rel=1e-6)


def test_a_refusal_names_the_model_size_the_gpu_and_the_smallest_count_and_class():
    with pytest.raises(ConfigError) as error:
        check_fits(LADDER["70B"], "H100", 1, role="update", model="llama-70b")
    message, hint = error.value.message, error.value.hint
    assert "llama-70b (70.6B parameters, 131.4 GiB in bf16)" in message and "1 x H100 (80 GiB each)" in message
    assert "smallest count of H100 that fits is 2 ('H100:2')" in hint and "smallest class that fits is H200" in hint
    with pytest.raises(ConfigError, match="gpu_count|no count of A10G fits"):
        check_fits(LADDER["70B"], "A10G", 4, role="update", model="m", max_count=4)
    check_fits(LADDER["70B"], "H100", 2, role="update", model="m")  # fits: no error
    check_fits(LADDER["70B"], "H100", 2, role="rollout", model="m", engine="vllm")


def test_the_transformers_engine_refuses_a_model_one_gpu_cannot_hold_naming_vllm(tmp_path, monkeypatch):
    shape = LADDER["32B"]
    directory = tmp_path / "m32"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.intermediate, "vocab_size": shape.vocab}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 24 * GIB}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L4")
    with pytest.raises(ConfigError) as error:
        memory_plan.load_device(str(directory), "cuda", "bf16", "transformers")
    assert "32.8B parameters" in error.value.message and "one GPU of 24 GiB (NVIDIA L4)" in error.value.message
    assert "vLLM" in error.value.hint and "tensor_parallel_size" in error.value.hint
    assert memory_plan.load_device("tiny", "cuda", "bf16", "transformers") == "cuda"


def test_docs_scaling_table_is_the_planners():
    assert largest_model_table() in (REPO / "docs" / "scaling.md").read_text()
