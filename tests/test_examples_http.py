"""Every example trains to the same result through the local backend and through `tinkerless serve`.

Each example's own config (env, reward, tasks, agents, algorithm) runs on the tiny model for
two steps, once in-process and once over HTTP against a live server on 127.0.0.1 that hosts the
run: same seed, same rewards step by step, byte-identical adapters in the last checkpoint.
A random tiny model rarely earns these rewards, so most examples give no gradient in two
steps here (guess_number does); runs that do train are compared in test_http.py and
test_server_runs.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.cli.commands import load_config
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.run.trainer import train
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.storage import CheckpointStore, ObjectStore

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    from tinkerless.functions.worker import Worker

    storage = tmp_path_factory.mktemp("server")
    with running(create_app(Worker(tiny_model), storage=str(storage))) as url:
        yield url, storage


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    """A server on a tiny LLaVA-style model, for the examples whose model sees (examples/vision_*.py)."""
    from tinkerless.functions.vision.models import build_tiny_llava
    from tinkerless.functions.worker import Worker

    model = build_tiny_llava(tmp_path_factory.mktemp("vlm") / "llava")
    storage = tmp_path_factory.mktemp("vlm-server")
    with running(create_app(Worker(model), storage=str(storage))) as url:
        yield url, storage, model


def _adapters(storage: Path, run_id: str, step: int) -> dict[str, bytes]:
    files = CheckpointStore(ObjectStore(str(storage)), f"runs/{run_id}/checkpoints").load(step).files
    return {name: data for name, data in files.items() if name.endswith("adapter_model.safetensors")}


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_gives_the_same_run_locally_and_over_http(example, tiny_model, server, request, tmp_path):
    from tinkerless.functions.vision.models import VISION_MODELS

    url, server_storage = server
    config = load_config(str(example))
    if config.model in VISION_MODELS:  # an example whose model sees: the same run on a tiny vision-language model
        url, server_storage, tiny_model = request.getfixturevalue("vlm_server")
    config = config.replace(
        model=tiny_model, steps=2, batch_size=2, group_size=2, max_tokens=4, checkpoint_every=1, progress=False,
        run_id=f"ex-{example.stem.replace('_', '-')}", seed=11,
    )
    local = train(config.replace(storage=str(tmp_path / "local")), backend=LocalBackend(tiny_model))
    remote = train(config.replace(storage=str(tmp_path / "client")), backend=HTTPBackend(url, timeout=300))

    assert len(local.metrics) == len(remote.metrics) == 2
    for ours, theirs in zip(remote.metrics, local.metrics):
        assert _same(ours["reward_mean"], theirs["reward_mean"]), (ours["reward_mean"], theirs["reward_mean"])
        assert (ours["episodes"], ours["trained_sequences"]) == (theirs["episodes"], theirs["trained_sequences"])
    expected = _adapters(tmp_path / "local", config.run_id, 2)
    assert expected, "the checkpoint holds no adapter"
    assert _adapters(server_storage / "tenants/_", config.run_id, 2) == expected
