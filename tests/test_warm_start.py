"""Warm start (`init_from`): RL from an SFT checkpoint, SFT from an RL checkpoint, a PEFT directory,
and every way to point at the wrong thing (unknown run or step, another base model, another rank)."""

from __future__ import annotations

import pytest

import tinkerless
from tinkerless.errors import ConfigError, UserError
from tinkerless.functions.models import build_tiny_model
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.backends.run_host import StorageRunHost
from tinkerless.sdk.checkpoints.warm_start import apply_init_from, parse_init_from
from tinkerless.storage import CheckpointStore, ObjectStore

DATA = [{"messages": [{"role": "user", "content": f"n{i}"}, {"role": "assistant", "content": f"{i}{i}"}]} for i in range(8)]


def _weights(files: dict[str, bytes]) -> dict:
    from safetensors.torch import load

    return load(files["adapter/adapter_model.safetensors"])


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def _checkpoint(storage, run_id: str, step: int) -> dict[str, bytes]:
    return CheckpointStore(ObjectStore(str(storage)), f"runs/{run_id}/checkpoints").load(step).files


@pytest.fixture(scope="module")
def sft_run(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("warm")
    tinkerless.sft(model=tiny_model, data=DATA, steps=4, batch_size=4, learning_rate=5e-2, checkpoint_every=2,
                   keep_checkpoints=None, storage=str(storage), run_id="sft-a", progress=False)
    return storage


def _loaded(tiny_model, storage, init_from: str, *, rank: int = 16, model: str | None = None) -> dict:
    backend = LocalBackend(tiny_model)
    client = TrainingClient(backend, "default", tinkerless.LoraConfig(rank=rank), namespace="t")
    apply_init_from(init_from, client, StorageRunHost(ObjectStore(str(storage)), backend), model or tiny_model, rank)
    state = client.save_state()
    assert state.policy_version == 0
    return _weights(state.files)


def test_init_from_loads_exactly_that_checkpoint_step_or_the_latest(tiny_model, sft_run):
    at2, at4 = _weights(_checkpoint(sft_run, "sft-a", 2)), _weights(_checkpoint(sft_run, "sft-a", 4))
    assert not _same_weights(at2, at4)
    assert _same_weights(_loaded(tiny_model, sft_run, "sft-a@2"), at2)
    assert _same_weights(_loaded(tiny_model, sft_run, "sft-a@latest"), at4)


def test_rl_from_an_sft_checkpoint_and_sft_from_that_rl_checkpoint(tiny_model, sft_run):
    rl = tinkerless.train(
        model=tiny_model, reward=lambda completion, task: float(len(completion) % 2), tasks=[{"prompt": "n1"}],
        steps=1, batch_size=2, group_size=4, max_tokens=6, temperature=1.0, storage=str(sft_run), run_id="rl-b",
        init_from="sft-a@latest", progress=False,
    )
    # The RL run's first step sampled from the SFT adapter: its step-1 adapter is one update away from it.
    start, after = _weights(_checkpoint(sft_run, "sft-a", 4)), _weights(_checkpoint(sft_run, rl.run_id, 1))
    assert start.keys() == after.keys()
    distance = sum(float((start[k] - after[k]).abs().max()) for k in start)
    assert 0 < distance < 1.0 or rl.metrics[0]["trained_sequences"] == 0
    back = tinkerless.sft(model=tiny_model, data=DATA, steps=1, batch_size=2, storage=str(sft_run), run_id="sft-c",
                          init_from="rl-b@1", progress=False)
    assert back.last_checkpoint_step == 1


def test_a_peft_adapter_directory_warm_starts_a_run(tiny_model, sft_run, tmp_path):
    directory = tmp_path / "adapter"
    directory.mkdir()
    for name, data in _checkpoint(sft_run, "sft-a", 2).items():
        if name.startswith("adapter/"):
            (directory / name.split("/", 1)[1]).write_bytes(data)
    assert _same_weights(_loaded(tiny_model, sft_run, str(directory)), _weights(_checkpoint(sft_run, "sft-a", 2)))


def test_wrong_sources_are_refused_before_anything_is_loaded(tiny_model, sft_run, tmp_path):
    with pytest.raises(UserError, match="no run 'ghost'") as info:
        _loaded(tiny_model, sft_run, "ghost@latest")
    assert "tinkerless runs" in info.value.hint
    with pytest.raises(UserError, match=r"cannot load that checkpoint of run 'sft-a'.*available steps: \[2, 4\]"):
        _loaded(tiny_model, sft_run, "sft-a@3")
    with pytest.raises(ConfigError, match="neither an adapter directory nor"):
        parse_init_from("sft-a")
    with pytest.raises(ConfigError, match="neither an adapter directory nor"):
        parse_init_from("sft-a@last")
    with pytest.raises(ConfigError, match="LoRA rank 16, this run lora_rank=8"):
        _loaded(tiny_model, sft_run, "sft-a@2", rank=8)
    (tmp_path / "not-an-adapter").mkdir()
    with pytest.raises(UserError, match="without adapter_config.json"):
        _loaded(tiny_model, sft_run, str(tmp_path / "not-an-adapter"))


def test_a_checkpoint_of_another_base_model_is_refused(tiny_model, sft_run, tmp_path):
    other = build_tiny_model(tmp_path / "other-model", hidden_size=64, num_layers=2, seed=1)  # same shapes, other weights
    with pytest.raises(ConfigError, match="base model") as info:
        tinkerless.train(model=other, reward=lambda completion, task: 0.0, tasks=[{"prompt": "x"}], steps=1,
                         storage=str(sft_run), init_from="sft-a@latest", progress=False)
    assert "set model=" in info.value.hint
    directory = tmp_path / "adapter"
    directory.mkdir()
    for name, data in _checkpoint(sft_run, "sft-a", 2).items():
        if name.startswith("adapter/"):
            (directory / name.split("/", 1)[1]).write_bytes(data)
    with pytest.raises(ConfigError, match="is an adapter of base model"):
        tinkerless.sft(model=other, data=DATA, steps=1, storage=str(tmp_path), init_from=str(directory), progress=False)
    assert not (tmp_path / "runs").exists()  # refused before the run was created


def test_init_from_is_checked_in_the_config():
    with pytest.raises(ConfigError, match="init_from"):
        tinkerless.TrainConfig(reward=lambda completion, task: 0.0, tasks=[{"prompt": "x"}], init_from="").validate()
