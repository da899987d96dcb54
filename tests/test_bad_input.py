"""Bad input gets a clear, typed error, and nothing already done is lost.

Every case runs the real `tinkerless.train` on the tiny model with a real
local store under tmp_path; only the inputs are broken.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

import pytest

import tinkerless
from tinkerless.coordinator import checkpoint_prefix, list_runs
from tinkerless.errors import (
    ConfigError,
    DatasetError,
    EnvError,
    ModelNotFoundError,
    RewardError,
    UserCodeError,
)
from tinkerless.sdk.run.metrics import read_metrics
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.wire import decode_message

TASKS = [{"prompt": "2+3?", "answer": "5"}, {"prompt": "1+1?", "answer": "2"}]


def settings(model: str, tmp_path: Path, **changes) -> dict:
    base = dict(
        model=model,
        storage=str(tmp_path),
        steps=2,
        batch_size=2,
        group_size=2,
        max_tokens=4,
        progress=False,
    )
    base.update(changes)
    return base


def run_state(tmp_path: Path, run_id: str):
    (state,) = [r for r in list_runs(ObjectStore(str(tmp_path))) if r.run_id == run_id]
    return state


def checkpoints(tmp_path: Path, run_id: str) -> CheckpointStore:
    return CheckpointStore(ObjectStore(str(tmp_path)), checkpoint_prefix(run_id))


@tinkerless.reward
def length_reward(completion: str, task: dict) -> float:
    return float(len(completion) % 3)


@tinkerless.env
class BoomEnv:
    """Raises in step() for tasks that ask for it."""

    def reset(self, prompt: str = "go", boom: bool = False, **_):
        self.boom = boom
        return prompt

    def step(self, action: str):
        if self.boom:
            raise ValueError("kaboom on purpose")
        return tinkerless.StepResult(reward=float(len(action) % 2), done=True)


@tinkerless.env
class CalmEnv:
    def reset(self, prompt: str = "go", **_):
        return prompt

    def step(self, action: str):
        return tinkerless.StepResult(reward=float(len(action) % 2), done=True)


# ---- (a) an env that raises ---------------------------------------------------------------


def test_env_step_errors_are_skipped_and_recorded(tiny_model, tmp_path):
    tasks = [{"prompt": "explode", "boom": True}, {"prompt": "stay calm", "boom": False}]
    result = tinkerless.train(env=BoomEnv, tasks=tasks, run_id="skip", on_env_error="skip", **settings(tiny_model, tmp_path))

    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        # each step sees both tasks once (one epoch of 2 tasks), so exactly one group of 2 fails
        assert record["episodes"] == 4 and record["episodes_error"] == 2
        assert len(record["errors"]) == 2
        for error in record["errors"]:
            assert "BoomEnv.step (turn 1): ValueError: kaboom on purpose" in error["error"]
            assert error["traceback"].startswith("Traceback (most recent call last)")
            assert "kaboom on purpose" in error["traceback"] and "in step" in error["traceback"]
        assert record["reward_mean"] == record["reward_mean"]  # the healthy episodes still have rewards
    state = run_state(tmp_path, "skip")
    assert state.status == "finished" and state.step == 2
    assert result.last_checkpoint_step == 2


def test_env_error_with_raise_keeps_earlier_checkpoints(tiny_model, tmp_path):
    calls = itertools.count()

    def make_task(rng):
        # each task index is made once, in order (the checks before the run make tasks 0-1, which step 0
        # reuses): tasks 0-3 (steps 0 and 1) are fine, task 5 (in step 2) explodes
        return {"prompt": f"task {rng.randint(0, 9)}", "boom": next(calls) >= 5}

    kwargs = settings(tiny_model, tmp_path, steps=4, checkpoint_every=1)
    with pytest.raises(EnvError) as info:
        tinkerless.train(env=BoomEnv, tasks=make_task, run_id="raise", on_env_error="raise", **kwargs)
    message = str(info.value)
    assert "BoomEnv.step" in message and "kaboom on purpose" in message
    assert "at step 2" in message
    assert "on_env_error='skip'" in info.value.hint

    state = run_state(tmp_path, "raise")
    assert state.status == "failed" and state.last_checkpoint_step == 2
    records = read_metrics(tmp_path / "runs" / "raise" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    checkpoint = checkpoints(tmp_path, "raise").load_latest()
    assert checkpoint is not None and checkpoint.step == 2
    assert json.loads(checkpoint.files["client.json"])["step"] == 2
    assert "adapter/adapter_model.safetensors" in checkpoint.files

    # the run continues from that checkpoint once the env is fixed
    result = tinkerless.train(env=CalmEnv, tasks=TASKS, run_id="raise", resume=True, **{**kwargs, "steps": 3})
    assert [r["step"] for r in result.metrics] == [0, 1, 2]
    assert run_state(tmp_path, "raise").status == "finished"


# ---- (b) rewards that are not numbers ------------------------------------------------------


@tinkerless.reward
def picky_reward(completion: str, task: dict):
    return {"nan": float("nan"), "str": "high", "ok": 1.0}[task["kind"]]


def test_bad_reward_values_drop_only_their_episodes(tiny_model, tmp_path):
    tasks = [{"prompt": "a", "kind": "nan"}, {"prompt": "b", "kind": "str"}, {"prompt": "c", "kind": "ok"}]
    result = tinkerless.train(
        reward=picky_reward, tasks=tasks, run_id="picky", **settings(tiny_model, tmp_path, batch_size=3)
    )
    assert len(result.metrics) == 2
    for record in result.metrics:
        assert record["episodes"] == 6 and record["episodes_error"] == 4
        assert record["reward_mean"] == 1.0  # only the "ok" episodes count
        texts = [e["error"] for e in record["errors"]]
        assert all("picky_reward" in t for t in texts)
        assert sum("returned nan, which is not a finite number" in t for t in texts) == 2
        assert sum("returned 'high' (str), not a number" in t for t in texts) == 2
        assert all("RewardError" in e["traceback"] for e in record["errors"])


@tinkerless.reward
def always_string(completion, task):
    return "great"


@tinkerless.reward
def always_nan(completion, task):
    return float("nan")


@tinkerless.reward
def always_raises(completion, task):
    return 1 / 0


@pytest.mark.parametrize(
    "reward, detail",
    [
        (always_string, "returned 'great' (str), not a number"),
        (always_nan, "returned nan, which is not a finite number"),
        (always_raises, "ZeroDivisionError"),
    ],
)
def test_run_stops_when_every_episode_fails(tiny_model, tmp_path, reward, detail):
    with pytest.raises((EnvError, RewardError)) as info:
        tinkerless.train(reward=reward, tasks=TASKS, run_id="allbad", **settings(tiny_model, tmp_path))
    message = str(info.value)
    assert reward.__name__ in message and detail in message
    assert "4 of 4 episodes failed at step 0" in message
    assert "nothing to train on" in info.value.hint
    assert run_state(tmp_path, "allbad").status == "failed"


# ---- (c) user code that cannot be shipped --------------------------------------------------


def test_unpicklable_reward_fails_before_any_model_loads(tmp_path):
    lock = threading.Lock()

    @tinkerless.reward
    def locked_reward(completion, task):
        with lock:
            return 1.0

    # A model path that does not exist: if anything tried to load it, this would be a ModelNotFoundError.
    with pytest.raises(UserCodeError) as info:
        tinkerless.train(reward=locked_reward, tasks=TASKS, **settings("/nonexistent/model", tmp_path))
    assert type(info.value) is UserCodeError
    assert "locked_reward" in str(info.value) and "lock" in str(info.value).lower()
    assert "cloudpickle" in info.value.hint
    assert not (tmp_path / "runs").exists()  # no half-created run left behind


def test_unpicklable_env_fails_before_any_model_loads(tmp_path):
    @tinkerless.env
    class LockedEnv:
        lock = threading.Lock()

        def reset(self, **task):
            return "hi"

        def step(self, action):
            return tinkerless.StepResult(done=True)

    with pytest.raises(UserCodeError, match="LockedEnv"):
        tinkerless.train(env=LockedEnv, tasks=TASKS, **settings("/nonexistent/model", tmp_path))
    assert not (tmp_path / "runs").exists()


# ---- (d) models that do not exist ------------------------------------------------------------


def test_missing_local_model_dir(tmp_path):
    with pytest.raises(ModelNotFoundError) as info:
        tinkerless.train(reward=length_reward, tasks=TASKS, **settings("/nonexistent/dir", tmp_path))
    assert "/nonexistent/dir" in str(info.value)
    assert info.value.hint and "smollm2" in info.value.hint


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "empty-model").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json") as info:
        tinkerless.train(reward=length_reward, tasks=TASKS, **settings(str(tmp_path / "empty-model"), tmp_path))
    assert info.value.hint


def test_unknown_hub_id_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with the hub online; this test never touches the network")
    with pytest.raises(ModelNotFoundError) as info:
        tinkerless.train(
            reward=length_reward, tasks=TASKS, **settings("no-such-org/surely-not-a-model-8c1f", tmp_path)
        )
    assert "no-such-org/surely-not-a-model-8c1f" in str(info.value)
    assert "Hugging Face cache" in info.value.hint


@pytest.mark.parametrize("changes", [{"model": "/nonexistent/dir"}, {"backend": "no-such-backend"}])
def test_startup_failure_leaves_no_running_run(tiny_model, tmp_path, changes):
    with pytest.raises((ModelNotFoundError, ConfigError)):
        tinkerless.train(reward=length_reward, tasks=TASKS, run_id="ghost", **{**settings(tiny_model, tmp_path), **changes})
    assert [r.status for r in list_runs(ObjectStore(str(tmp_path))) if r.status == "running"] == []


# ---- (e) datasets ----------------------------------------------------------------------------


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "make_tasks, pattern",
    [
        (lambda d: [], "the task dataset is empty"),
        (lambda d: [{"prompt": "a"}, "not a dict"], "task 1 is a str, not a dict"),
        (lambda d: write(d / "tasks.jsonl", '{"prompt": "a"}\n\n{"prompt": oops}\n'), r"tasks\.jsonl:3 is not valid JSON"),
        (lambda d: write(d / "list.jsonl", '{"prompt": "a"}\n[1, 2]\n'), r"list\.jsonl:2 is a list, not a dict"),
        (lambda d: write(d / "blank.jsonl", "\n\n"), "the task dataset is empty"),
        (lambda d: str(d / "missing.jsonl"), r"missing\.jsonl does not exist"),
        (lambda d: (lambda rng: ["not", "a", "dict"]), "task function '.*' returned a list, not one task dict"),
        (lambda d: (lambda rng: 1 / 0), "raised at task 0: ZeroDivisionError"),
        (lambda d: 42, "tasks is a int, which is not a form of tasks"),
    ],
    ids=["empty", "non-dict", "bad-json-line", "jsonl-non-dict", "blank-jsonl", "missing-file", "gen-non-dict", "gen-raises", "int"],
)
def test_bad_datasets_fail_before_any_model_loads(tmp_path, make_tasks, pattern):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    storage = tmp_path / "store"
    with pytest.raises(DatasetError, match=pattern) as info:
        tinkerless.train(reward=length_reward, tasks=make_tasks(data_dir), **settings("/nonexistent/model", storage))
    assert info.value.hint
    assert not (storage / "runs").exists()


def test_single_turn_task_without_prompt(tiny_model, tmp_path):
    tasks = [{"question": "2+3?"}, {"question": "1+1?"}]
    with pytest.raises(DatasetError) as info:
        tinkerless.train(reward=length_reward, tasks=tasks, run_id="noprompt", **settings(tiny_model, tmp_path))
    message = str(info.value)
    assert "has no 'prompt'" in message and "question" in message
    assert "messages" in info.value.hint
    assert run_state(tmp_path, "noprompt").status == "failed"


# ---- (f) configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"loss": "nope"}, "unknown loss 'nope'"),
        ({"algo": "ppo2"}, "unknown algo 'ppo2'"),
        ({"steps": 0}, "steps must be at least 1, got 0"),
        ({"batch_size": -1}, "batch_size must be at least 1"),
        ({"on_env_error": "ignore"}, "on_env_error must be 'skip' or 'raise'"),
        ({"run_id": "../escape"}, "invalid run_id"),
        ({"reward": None}, "needs an env, a reward, or both"),
        ({"tasks": None}, "needs tasks"),
        ({"normalization": "per-token"}, "normalization"),
    ],
)
def test_config_errors(tmp_path, changes, pattern):
    kwargs = {"reward": length_reward, "tasks": TASKS, **settings("/nonexistent/model", tmp_path), **changes}
    with pytest.raises(ConfigError, match=pattern):
        tinkerless.train(**kwargs)
    assert not (tmp_path / "runs").exists()


def test_config_replace_rejects_unknown_field():
    config = tinkerless.TrainConfig(reward=length_reward, tasks=TASKS)
    with pytest.raises(ConfigError, match="stpes"):
        tinkerless.train(config, stpes=3)


def test_train_kwargs_reject_unknown_setting_with_config_error(tmp_path):
    with pytest.raises(ConfigError, match="stpes"):
        tinkerless.train(reward=length_reward, tasks=TASKS, stpes=3, **settings("/nonexistent/model", tmp_path))


# ---- (g) a corrupt checkpoint ------------------------------------------------------------------


class RecordingBackend:
    """A real LocalBackend that keeps the methods and payloads it was sent."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[str, bytes]] = []

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        self.calls.append((method, payload))
        return self.inner.call_bytes(method, payload)

    def close(self) -> None:
        self.inner.close()


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tiny_model, tmp_path):
    from tinkerless.sdk.backends.base import LocalBackend

    kwargs = settings(tiny_model, tmp_path, checkpoint_every=1)
    first = tinkerless.train(reward=length_reward, tasks=TASKS, run_id="ckpt", **kwargs)
    assert first.last_checkpoint_step == 2
    first_records = read_metrics(first.run_dir / "metrics.jsonl")

    step_dir = tmp_path / "runs" / "ckpt" / "checkpoints"
    good_adapter = (step_dir / "step-1" / "adapter" / "adapter_model.safetensors").read_bytes()
    adapter = step_dir / "step-2" / "adapter" / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[len(data) // 2] ^= 0xFF
    adapter.write_bytes(bytes(data))

    backend = RecordingBackend(LocalBackend(tiny_model))
    with pytest.warns(RuntimeWarning, match="skipped checkpoint step 2") as caught:
        resumed = tinkerless.train(
            reward=length_reward, tasks=TASKS, run_id="ckpt", backend=backend, **{**kwargs, "steps": 3, "resume": True}
        )
    warning = next(str(w.message) for w in caught if "skipped checkpoint step 2" in str(w.message))
    assert "adapter/adapter_model.safetensors" in warning and "does not match its manifest" in warning

    # the state that was loaded is step 1's, never the corrupt step 2
    (load,) = [decode_message(p) for m, p in backend.calls if m == "load_state"]
    assert load.state.files["adapter/adapter_model.safetensors"] == good_adapter
    # steps 1 and 2 were trained again: two rollouts
    assert [m for m, _ in backend.calls].count("rollout") == 2

    records = read_metrics(resumed.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0] == first_records[0]  # step 0 kept as it was
    assert records[1]["step_s"] != first_records[1]["step_s"]  # step 1 is a new record, not the old one
    state = run_state(tmp_path, "ckpt")
    assert state.status == "finished" and state.step == 3
    latest = checkpoints(tmp_path, "ckpt").load_latest()
    assert latest is not None and latest.step == 3  # the corrupt step-2 was rewritten on the way
    assert checkpoints(tmp_path, "ckpt").load(2).step == 2
