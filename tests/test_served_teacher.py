"""On-policy distillation from another base model that `tinkerless serve` holds beside the policy's
(`--also-model`): the run through the server trains on the same advantages as the local backend's second-model
teacher for the same seed, token for token with one vocabulary and through the cross-tokenizer alignment with
another; the teacher's seconds are the run's `teacher` line and the key's usage counts its calls under the
model's id; a teacher the server does not hold is refused before the first step, naming the models it holds."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import build_other_vocabulary_model
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.errors import TinkerlessError
from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message


def _task(rng):
    return {"prompt": "say " + str(rng.randint(0, 99))}


SETTINGS = dict(tasks=_task, batch_size=2, group_size=2, max_tokens=8, temperature=1.0, learning_rate=1e-2, steps=1,
                checkpoint_every=1, progress=False, transcripts_per_step=0, seed=7)


def _updates(calls: list[tuple[str, bytes]]) -> list:
    return [d for method, payload in calls if method == "update" for d in decode_message(payload).data]


class RecordingLocal(LocalBackend):
    """The local backend, keeping every update request (what the policy trained on)."""

    def __init__(self, model: str):
        super().__init__(model)
        self.calls: list[tuple[str, bytes]] = []

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        self.calls.append((method, payload))
        return super().call_bytes(method, payload)


class RecordingWorker(Worker):
    """The server's main worker, keeping every update request it runs."""

    calls: list[tuple[str, bytes]]

    def handle(self, method: str, payload: bytes) -> bytes:
        self.calls.append((method, payload))
        return super().handle(method, payload)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-teacher")
    student = build_tiny_model(root / "student", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    same = build_tiny_model(root / "same-vocab", hidden_size=64, num_layers=2, seed=1, initializer_range=0.2)
    other = build_other_vocabulary_model(root / "other-vocab")
    storage = root / "server"
    keys = KeyStore(ObjectStore(str(storage)))
    key = keys.create("lab")
    worker = RecordingWorker(student)
    worker.calls = []
    app = create_app(worker, keys=keys, storage=str(storage), price_per_hour=3600.0,
                     models={same: Worker(same), other: Worker(other)})
    with serve_in_thread(app) as url:
        yield dict(student=student, same=same, other=other, url=url, key=key, worker=worker, storage=storage,
                   root=root)


def _usage(url: str, key: str) -> dict:
    return httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()


def _adapter(path: Path) -> bytes:
    return path.read_bytes()


@pytest.mark.parametrize("which", ["same", "other"])
def test_a_served_teacher_trains_the_student_as_the_local_second_model_does(setup, which):
    student, teacher, url, key = setup["student"], setup[which], setup["url"], setup["key"]
    local_backend = RecordingLocal(student)
    local = tinkerless.train(model=student, teacher=teacher, backend=local_backend, run_id=f"local-{which}",
                             storage=str(setup["root"] / "local"), **SETTINGS)
    setup["worker"].calls = []
    before = _usage(url, key)
    served = tinkerless.train(model=student, teacher=teacher, backend=HTTPBackend(url, api_key=key),
                              run_id=f"served-{which}", storage=str(setup["root"] / "client"), **SETTINGS)
    after = _usage(url, key)

    # The same trained tokens and advantages (the teacher's log-prob minus the sampler's), bit for bit.
    mine, theirs = _updates(local_backend.calls), _updates(setup["worker"].calls)
    # (With the other vocabulary a sequence with no aligned sampled token has nothing to train on.)
    assert len(mine) == len(theirs) >= (SETTINGS["batch_size"] * SETTINGS["group_size"] if which == "same" else 1)
    for a, b in zip(mine, theirs):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.mask, b.mask)
        np.testing.assert_array_equal(a.advantages, b.advantages)
        assert np.abs(a.advantages[a.mask > 0]).max() > 1e-3  # the teacher differs: the test says something
    for column in ("teacher_logprob_gap", "teacher_aligned_share", "teacher_aligned_tokens", "loss"):
        assert served.metrics[0][column] == local.metrics[0][column], column
    if which == "same":
        assert served.metrics[0]["teacher_aligned_share"] == 1.0
    else:  # the byte-level student against SmolLM2's vocabulary: aligned by character spans, the rest masked
        assert 0.0 < served.metrics[0]["teacher_aligned_share"] <= 1.0
    # And the same adapter after the step.
    local_file = setup["root"] / f"local/runs/local-{which}/checkpoints/step-1/adapter/adapter_model.safetensors"
    served_file = next(Path(setup["storage"]).glob(f"tenants/*/runs/served-{which}/checkpoints/step-1/adapter/"
                                                   "adapter_model.safetensors"))
    mine, theirs = load_safetensors(local_file.read_bytes()), load_safetensors(served_file.read_bytes())
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert hashlib.sha256(mine[name].numpy().tobytes()).hexdigest() == \
            hashlib.sha256(theirs[name].numpy().tobytes()).hexdigest(), name

    # The teacher's seconds are the run's `teacher` line, its calls counted under the model in the key's usage.
    assert served.usage["compute_seconds"]["teacher"] > 0
    forwards = served.usage["by_function"]["teacher/forward"]
    line, was = after["models"][teacher], before["models"].get(teacher, {"calls": 0, "compute_seconds": 0.0})
    assert line["calls"] - was["calls"] == forwards["calls"] > 0
    assert line["compute_seconds"] - was["compute_seconds"] == pytest.approx(forwards["seconds"], rel=0.05, abs=0.05)


def test_a_teacher_the_server_does_not_hold_is_refused_before_the_first_step(setup):
    url, key = setup["url"], setup["key"]
    for teacher in ("HuggingFaceTB/SmolLM2-360M-Instruct", str(setup["root"] / "nowhere"), setup["same"] + "x"):
        with pytest.raises(TinkerlessError) as refused:
            tinkerless.train(model=setup["student"], teacher=teacher, backend=HTTPBackend(url, api_key=key),
                             run_id="refused", storage=str(setup["root"] / "client"), **SETTINGS)
        assert refused.value.category == "user"
        assert "does not hold model" in str(refused.value)
        assert repr(setup["same"]) in str(refused.value) and repr(setup["other"]) in str(refused.value)
    assert not list(Path(setup["storage"]).glob("tenants/*/runs/refused"))  # refused before the run existed


def test_a_resumed_run_with_a_served_teacher_ends_as_the_uninterrupted_local_one(setup):
    """Stopped after its first step and resumed (a new client, the teacher opened again on the server): the same
    adapter at step 2 as a local run that went straight through with its second-model teacher."""
    student, teacher, url, key = setup["student"], setup["same"], setup["url"], setup["key"]
    settings = {**SETTINGS, "checkpoint_every": 1}
    tinkerless.train(model=student, teacher=teacher, backend="local", run_id="straight",
                     storage=str(setup["root"] / "local"), **{**settings, "steps": 2})
    client = str(setup["root"] / "client")
    tinkerless.train(model=student, teacher=teacher, backend=HTTPBackend(url, api_key=key), run_id="resumed",
                     storage=client, **{**settings, "steps": 1})
    resumed = tinkerless.train(model=student, teacher=teacher, backend=HTTPBackend(url, api_key=key), run_id="resumed",
                               storage=client, resume=True, **{**settings, "steps": 2})
    assert [r["step"] for r in resumed.metrics] == [0, 1] and resumed.metrics[1]["teacher_aligned_share"] == 1.0
    local_file = setup["root"] / "local/runs/straight/checkpoints/step-2/adapter/adapter_model.safetensors"
    served_file = next(Path(setup["storage"]).glob("tenants/*/runs/resumed/checkpoints/step-2/adapter/"
                                                   "adapter_model.safetensors"))
    assert served_file.read_bytes() == local_file.read_bytes()
