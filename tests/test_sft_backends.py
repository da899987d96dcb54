"""SFT on the cloud backends, offline: through the Modal backend (its classes' `.local()` bodies, as
tests/test_modal.py runs them) an SFT run and an RL run warm-started from it equal the local ones."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("modal")

from test_modal import built, fakes  # noqa: E402,F401  (fixtures: the Modal App's classes run in this process)

import tinkerless  # noqa: E402
from tinkerless.cloud.modal_backend import ModalBackend  # noqa: E402
from tinkerless.cloud.modal_config import ModalConfig  # noqa: E402

DATA = [{"messages": [{"role": "user", "content": f"n{i}"}, {"role": "assistant", "content": f"{i}{i}"}]} for i in range(8)]


def _adapter(storage: Path, run_id: str, step: int) -> bytes:
    return (storage / f"runs/{run_id}/checkpoints/step-{step}/adapter/adapter_model.safetensors").read_bytes()


def test_sft_then_warm_started_rl_through_the_modal_backend_equal_local(tiny_model, tmp_path, fakes):  # noqa: F811
    settings = dict(model=tiny_model, data=DATA, steps=3, batch_size=4, learning_rate=1e-2, checkpoint_every=3,
                    eval_fraction=0.25, eval_every=1, run_id="s", progress=False)
    rl = dict(model=tiny_model, reward=lambda completion, task: float(len(completion) % 2), tasks=[{"prompt": "n1"}],
              steps=1, batch_size=2, group_size=4, max_tokens=6, temperature=1.0, run_id="r", init_from="s@latest",
              progress=False, seed=3)
    local = tinkerless.sft(storage=str(tmp_path / "local"), backend="local", **settings)
    local_rl = tinkerless.train(storage=str(tmp_path / "local"), backend="local", **rl)

    def modal_backend():
        return ModalBackend(tiny_model, fakes, ModalConfig(), state_dir=str(tmp_path / "volume"), volume="",
                            engine="auto", micro_batch_size=16)  # fmt: skip

    remote = tinkerless.sft(storage=str(tmp_path / "modal"), backend=modal_backend(), **settings)
    remote_rl = tinkerless.train(storage=str(tmp_path / "modal"), backend=modal_backend(), **rl)
    assert [m["train_nll"] for m in remote.metrics] == [m["train_nll"] for m in local.metrics]
    assert [m["eval_nll"] for m in remote.metrics] == [m["eval_nll"] for m in local.metrics]
    assert _adapter(tmp_path / "modal", "s", 3) == _adapter(tmp_path / "local", "s", 3)
    assert [m["reward_mean"] for m in remote_rl.metrics] == [m["reward_mean"] for m in local_rl.metrics]
    assert _adapter(tmp_path / "modal", "r", 1) == _adapter(tmp_path / "local", "r", 1)
    assert remote.usage["device"] == "Modal L40S"  # billed as Modal's GPU
