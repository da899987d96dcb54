"""The Modal backend, offline: its config, the App built from it, the class bodies through `.local()`
(equal to the local backend), fan-out, the coordinator resuming from its Volume directory, the
missing-token error, and `modal run examples/...`.

The one fake is Modal's network boundary: `_LocalClasses` gives `.remote` and `.map` that run
the classes' `.local()` bodies (enter hook included) in this process, with a temporary directory
in place of the Volume. No test sets a Modal token.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

modal = pytest.importorskip("modal")

from tinkerless.cloud import modal_app
from tinkerless.cloud.modal_backend import ModalBackend, chunk_seed, role_for, split_rollout
from tinkerless.cloud.modal_config import CONFIG_ENV, GPU_TYPES, ClassSpec, ModalConfig
from tinkerless.cloud.modal_entry import run_on_modal, ship_config
from tinkerless.cloud.modal_volume import AdapterStore, model_key
from tinkerless.errors import ConfigError, StorageNotFound
from tinkerless.functions.losses import LossConfig
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.trainer import train
from tinkerless.wire import decode_message, encode_message, pack_code
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
    Datum,
    EpisodeLimits,
    ErrorReply,
    ForwardRequest,
    LoraConfig,
    RolloutRequest,
    SamplingParams,
    SaveStateRequest,
    UpdateRequest,
)

# `.local()` warns that it cannot mount the Volume: these tests pass a directory in its place.
pytestmark = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def ascii_reward(completion: str, task: dict) -> float:
    """Varies a lot on a tiny random model's byte soup, so every group has a learning signal."""
    return sum(c.isascii() for c in completion) / max(len(completion), 1)


def make_task(rng) -> dict:
    return {"prompt": "say " + str(rng.randint(0, 99))}


# ---- the single fake: Modal's network boundary -----------------------------------------
class _LocalClasses:
    """Stands in for a `modal.Cls` where calls leave this machine: `.remote` runs the `.local()` body
    on one warm "container"; `.map` starts a fresh "container" per item (a new instance: its enter
    hook loads the model and it restores adapters from the Volume directory), as Modal scales out.
    `overrides` put a temporary directory where the Volume is mounted."""

    def __init__(self, cls, method: str = "call", **overrides):
        self.cls, self.method, self.overrides, self.log = cls, method, overrides, []
        self.models: list[str] = []  # the model each warm "container" was made for, once per `.remote` call

    def __call__(self, **params):
        params = {**params, **self.overrides}
        instance = self.cls(**params)
        warm = getattr(instance, self.method)

        def remote(*args):
            self.log.append(("remote", args[0]))
            self.models.append(params.get("model"))
            return warm.local(*args)

        def map_(*iterables):
            results = []
            for args in zip(*iterables):
                self.log.append(("map", args[0]))
                results.append(getattr(self.cls(**params), self.method).local(*args))
            return iter(results)

        files = getattr(instance, "tokenizer_files", None)
        tokenizer = SimpleNamespace(remote=lambda: files.local()) if files is not None else None
        return SimpleNamespace(**{self.method: SimpleNamespace(remote=remote, map=map_)}, tokenizer_files=tokenizer)


@pytest.fixture(scope="module")
def built():
    return modal_app.build_app(ModalConfig())


@pytest.fixture()
def fakes(built):
    return {role: _LocalClasses(built.classes[role]) for role in ("rollout", "forward", "update")}


def _assert_same(got, expected, where="reply"):
    """Decoded replies are equal field by field (timings aside)."""
    if dataclasses.is_dataclass(expected):
        assert type(got) is type(expected), where
        for f in dataclasses.fields(expected):
            _assert_same(getattr(got, f.name), getattr(expected, f.name), f"{where}.{f.name}")
    elif isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(got, expected, err_msg=where)
    elif isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            if key != "seconds" and not key.endswith("_s"):  # timings: generate_s, env_s, ...
                _assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


# ---- config ------------------------------------------------------------------------------
def test_config_defaults_are_valid_and_map_onto_the_decorators():
    config = ModalConfig()
    assert config.python_version == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert config.update.max_containers == 1 and config.coordinator.max_containers == 1
    assert config.coordinator.gpu is None and config.rollout.max_containers > 1
    spec = ClassSpec(gpu="H100", gpu_count=2, timeout=600, retries=2, min_containers=1, max_containers=4,
                     scaledown_window=120, cpu=8.0, memory=32768)  # fmt: skip
    assert spec.cls_options() == {
        "gpu": "H100:2", "timeout": 600, "retries": 2, "min_containers": 1, "max_containers": 4,
        "scaledown_window": 120, "cpu": 8.0, "memory": 32768,
    }  # fmt: skip
    assert ClassSpec(gpu="L4").gpu_request() == "L4" and ClassSpec(gpu=None).cls_options()["gpu"] is None
    assert "cpu" not in ClassSpec().cls_options()  # Modal's own default unless set


def test_config_replace_sets_roles_and_gpu_shortcuts():
    config = ModalConfig().replace(gpu="A100-80GB", gpu_count=2, rollout={"max_containers": 16}, extras="vllm, s3",
                                   tasks_per_container=4)  # fmt: skip
    assert [getattr(config, r).gpu_request() for r in ("rollout", "forward", "update")] == ["A100-80GB:2"] * 3
    assert config.coordinator.gpu is None  # the shortcut touches GPU roles only
    assert config.rollout.max_containers == 16 and config.extras == ("vllm", "s3") and config.tasks_per_container == 4
    assert ModalConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"gpu": "h100"}, "did you mean 'H100'"),
        ({"gpu": "V100"}, "unknown GPU type 'V100'"),
        ({"gpu": "A10", "gpu_count": 5}, "gpu_count must be 1..4"),
        ({"update": {"max_containers": 2}}, "update.max_containers must be 1"),
        ({"coordinator": {"max_containers": 3}}, "coordinator.max_containers must be 1"),
        ({"rollout": {"min_containers": 9}}, "min_containers must be 0..max_containers (8)"),
        ({"rollout": {"scaledown_window": 1}}, "scaledown_window must be 2..3600"),
        ({"forward": {"timeout": 10**6}}, "timeout must be 10..86400"),
        ({"update": {"retries": -1}}, "retries must be 0..10"),
        ({"rollout": {"memory": 64}}, "memory must be at least 128"),
        ({"rollout": {"gpus": "H100"}}, "unknown setting(s) ['gpus'] for modal rollout"),
        ({"tasks_per_container": 0}, "tasks_per_container must be at least 1"),
        ({"python_version": "3.7"}, "differs from this Python"),
        ({"app_name": "bad name!"}, "not a valid Modal name"),
        ({"timeout": 5}, "unknown Modal setting(s) ['timeout']"),
    ],
)
def test_config_rejects_bad_settings_with_a_clear_error(changes, message):
    with pytest.raises(ConfigError) as info:
        ModalConfig().replace(**changes)
    assert message in str(info.value)


def test_config_from_env():
    env = {
        "TINKERLESS_MODAL_GPU": "H100",
        "TINKERLESS_MODAL_ROLLOUT_MAX_CONTAINERS": "32",
        "TINKERLESS_MODAL_UPDATE_GPU_COUNT": "2",
        "TINKERLESS_MODAL_COORDINATOR_CPU": "2.5",
        "TINKERLESS_MODAL_FORWARD_MEMORY": "none",
        "TINKERLESS_MODAL_APP_NAME": "my-rl",
        "TINKERLESS_MODAL_TASKS_PER_CONTAINER": "8",
        "TINKERLESS_MODAL_EXTRAS": "s3,vllm",
        "TINKERLESS_MODAL_SECRETS": "aws-keys, hf",
        "UNRELATED": "x",
    }
    config = ModalConfig.from_env(env)
    assert config.rollout.gpu_request() == "H100" and config.update.gpu_request() == "H100:2"
    assert config.rollout.max_containers == 32 and config.coordinator.cpu == 2.5 and config.forward.memory is None
    assert (config.app_name, config.tasks_per_container, config.extras) == ("my-rl", 8, ("s3", "vllm"))
    assert config.secrets == ("aws-keys", "hf")
    assert ModalConfig.from_env({}) == ModalConfig()
    # Containers get the resolved config as JSON, which wins over everything else.
    assert ModalConfig.from_env({CONFIG_ENV: config.to_json(), "TINKERLESS_MODAL_GPU": "T4"}) == config
    with pytest.raises(ConfigError, match="unknown Modal setting TINKERLESS_MODAL_ROLOUT_GPU"):
        ModalConfig.from_env({"TINKERLESS_MODAL_ROLOUT_GPU": "H100"})
    with pytest.raises(ConfigError, match="is not a number"):
        ModalConfig.from_env({"TINKERLESS_MODAL_ROLLOUT_TIMEOUT": "ten"})
    with pytest.raises(ConfigError, match="unreadable Modal config JSON"):
        ModalConfig.from_env({CONFIG_ENV: "{not json"})


def test_gpu_list_matches_modal_docs():
    assert {"T4", "L4", "A10", "L40S", "A100", "A100-40GB", "A100-80GB", "RTX-PRO-6000", "H100", "H100!", "H200",
            "B200", "B200+"} <= set(GPU_TYPES)  # fmt: skip


# ---- the App -----------------------------------------------------------------------------------
def test_app_is_built_from_the_config_without_contacting_anything(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("building the App must not create a Modal client")

    for name in ("from_env", "from_credentials"):
        monkeypatch.setattr(modal.client._Client, name, classmethod(no_network))
    config = ModalConfig(app_name="tl-test", volume_name="tl-vol", secrets=("aws-keys",)).replace(
        rollout={"gpu": "H100", "gpu_count": 2, "timeout": 900, "retries": 3, "memory": 65536},
        update={"gpu": "A100-80GB", "cpu": 4.0},
    )
    started = time.perf_counter()
    built = modal_app.build_app(config)
    assert time.perf_counter() - started < 10
    assert built.app.name == "tl-test" and set(built.classes) == {"rollout", "forward", "update", "coordinator"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # registered_functions is deprecated in modal 1.6, still the public view
        functions = built.app.registered_functions
    assert set(functions) == {"Rollout.*", "Forward.*", "Update.*", "Coordinator.*"}
    for role, tag in (("rollout", "Rollout.*"), ("forward", "Forward.*"), ("update", "Update.*"), ("coordinator", "Coordinator.*")):
        spec, info = getattr(config, role), functions[tag].info()
        assert info.gpus == ([(spec.gpu, spec.gpu_count)] if spec.gpu else []), role
        assert (info.timeout, info.max_retries, info.cpu, info.memory_mib) == (spec.timeout, spec.retries, spec.cpu, spec.memory), role
        assert {p: v.name for p, v in info.volumes.items()} == {"/tinkerless": "tl-vol"}, role
        assert info.method_names == (["train"] if role == "coordinator" else ["call", "tokenizer_files"])
        assert info.secrets == ["modal.Secret.from_name('aws-keys')"], role
    assert modal_app.source_pyproject() == REPO / "pyproject.toml"  # the image installs the project's own dependencies


def test_installed_requirements_follow_the_extras():
    base = modal_app.installed_requirements(())
    assert any(r.startswith("torch") for r in base) and not any(r.startswith("s3fs") for r in base)
    with_s3 = modal_app.installed_requirements(("s3",))
    assert any(r.startswith("s3fs") for r in with_s3) and set(base) < set(with_s3) and not any(r.startswith("vllm") for r in with_s3)
    assert not any(";" in r for r in with_s3)  # markers are resolved here, not shipped


def test_routing_sends_training_state_to_the_single_writer():
    assert [role_for(m) for m in ("rollout", "rollout_multi", "sample", "forward")] == ["rollout"] * 3 + ["forward"]
    assert {role_for(m) for m in ("create_policy", "update", "forward_backward", "optim_step", "save_state", "load_state", "info")} == {"update"}


def test_a_container_rebuilds_the_app_and_hydrates_the_sibling_classes():
    """Inside a container, importing modal_app rebuilds the App from the image's config JSON; Modal then
    hydrates its class handles from the running app's layout (simulated here with Modal's own
    container-side functions), which is how the coordinator reaches the GPU classes."""
    config = ModalConfig(app_name="tl-container")
    code = textwrap.dedent(
        """
        import importlib
        from modal_proto import api_pb2
        from modal.running_app import RunningApp
        from modal._runtime.user_code_imports import get_active_app_fallback
        from modal._utils.async_utils import synchronizer

        module = importlib.import_module("tinkerless.cloud.modal_app")
        function_def = api_pb2.Function(app_name="tl-container", function_name="Coordinator.*",
                                        module_name="tinkerless.cloud.modal_app")
        app = get_active_app_fallback(function_def)  # what Modal does for a class decorated in a function
        assert app is synchronizer._translate_in(module._CONTAINER.app)
        functions, classes, metadata = {}, {}, {}
        for i, tag in enumerate(["Rollout", "Forward", "Update", "Coordinator"]):
            functions[tag + ".*"], classes[tag] = f"fu-{i}", f"cs-{i}"
            call = api_pb2.FunctionHandleMetadata(function_name=tag + ".call")
            metadata[f"fu-{i}"] = api_pb2.FunctionHandleMetadata(function_name=tag + ".*", method_handle_metadata={"call": call})
            metadata[f"cs-{i}"] = api_pb2.ClassHandleMetadata()
        app._init_container(None, RunningApp("ap-1", function_ids=functions, class_ids=classes, object_handle_metadata=metadata))
        handles = module.sibling_classes()
        print(sorted((role, synchronizer._translate_in(c).object_id) for role, c in handles.items()))
        """
    )
    env = {**os.environ, "MODAL_IS_REMOTE": "1", CONFIG_ENV: config.to_json()}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[('forward', 'cs-1'), ('rollout', 'cs-0'), ('update', 'cs-2')]", out.stdout + out.stderr
    with pytest.raises(ConfigError, match="exist only inside a running Modal App"):
        modal_app.sibling_classes()  # outside a container


# ---- the class bodies through .local() ---------------------------------------------------------
def _datums(result) -> list[Datum]:
    signs = [1.0, -1.0] * len(result.episodes)
    return [
        Datum(tokens=e.tokens, mask=e.mask, advantages=(e.mask * s).astype(np.float32), sampler_logprobs=e.sampler_logprobs)
        for e, s in zip(result.episodes, signs)
    ]


def test_local_bodies_equal_the_local_backend(built, tiny_model, tmp_path):
    local = LocalBackend(tiny_model)
    volume = tmp_path / "volume"
    params = {"model": tiny_model, "state_dir": str(volume)}
    update, rollout, forward = (built.classes[r](**params) for r in ("update", "rollout", "forward"))

    def both(obj, method, request, versions):
        payload = encode_message(request)
        expected = decode_message(local.call_bytes(method, payload))
        reply, seconds = obj.call.local(method, payload, versions)
        assert seconds > 0
        got = decode_message(reply)
        _assert_same(got, expected, method)
        return got

    info = both(update, "info", {}, {})
    assert info["policies"] == {}
    both(update, "create_policy", CreatePolicyRequest("pol", LoraConfig(rank=4, alpha=8, seed=3)), {})
    request = RolloutRequest("pol", [make_task(random.Random(i)) for i in range(3)], 2,
                             SamplingParams(max_tokens=6, temperature=1.0), EpisodeLimits(), seed=11,
                             reward=pack_code(ascii_reward))  # fmt: skip
    result = both(rollout, "rollout", request, {"pol": 0})
    data = _datums(result)
    both(forward, "forward", ForwardRequest("pol", data, with_reference=True), {"pol": 0})
    adam = AdamParams(learning_rate=1e-2)
    assert both(update, "update", UpdateRequest("pol", data, LossConfig(), adam), {"pol": 0}).policy_version == 1

    # The writer committed v1 to the Volume: a new rollout container and the warm one both serve it.
    fresh = built.classes["rollout"](**params)
    both(fresh, "rollout", dataclasses.replace(request, seed=12), {"pol": 1})
    both(rollout, "rollout", dataclasses.replace(request, seed=13), {"pol": 1})
    both(forward, "forward", ForwardRequest("pol", data), {"pol": 1})

    # A replaced writer container restores adapter and optimizer from the Volume and trains on identically.
    restarted = built.classes["update"](**params)
    assert both(restarted, "update", UpdateRequest("pol", data, LossConfig(), adam), {"pol": 1}).policy_version == 2
    payload = encode_message(SaveStateRequest("pol"))
    expected = decode_message(local.call_bytes("save_state", payload))
    state = decode_message(restarted.call.local("save_state", payload, {"pol": 2})[0])
    assert state.policy_version == expected.policy_version == 2 and set(state.files) == set(expected.files)
    assert state.files["adapter/adapter_model.safetensors"] == expected.files["adapter/adapter_model.safetensors"]
    configs = [json.loads(s.files["adapter/adapter_config.json"]) for s in (state, expected)]
    for c in configs:  # PEFT writes target modules in set order; a restored policy lists them sorted
        c["target_modules"] = sorted(c["target_modules"])
    assert configs[0] == configs[1]
    ours, theirs = (torch.load(io.BytesIO(s.files["optimizer.pt"]), weights_only=True) for s in (state, expected))
    for key, tensors in theirs["state"].items():
        for name, value in tensors.items():
            assert torch.equal(ours["state"][key][name], value), (key, name)
    store = AdapterStore(volume / "adapters" / model_key(tiny_model))
    assert store.versions("pol") == [1, 2] and store.latest("pol") == 2  # keep_versions=2 pruned v0

    # A retried update (its reply was lost, the client still names v1) restarts from v1: applied once.
    retry = decode_message(restarted.call.local("update", encode_message(UpdateRequest("pol", data, LossConfig(), adam)), {"pol": 1})[0])
    assert retry.policy_version == 2
    assert decode_message(restarted.call.local("save_state", payload, {"pol": 2})[0]).files["adapter/adapter_model.safetensors"] == \
        expected.files["adapter/adapter_model.safetensors"]  # fmt: skip


def test_a_reader_reports_a_version_missing_from_the_volume(built, tiny_model, tmp_path):
    reader = built.classes["rollout"](model=tiny_model, state_dir=str(tmp_path))
    request = RolloutRequest("ghost", [{"prompt": "hi"}], 1, SamplingParams(max_tokens=2), EpisodeLimits(), seed=0)
    reply = decode_message(reader.call.local("rollout", encode_message(request), {"ghost": 4})[0])
    assert reply.type == "StorageNotFound" and "'ghost' version 4 is not on the Modal Volume" in reply.error
    wrong = decode_message(reader.call.local("update", encode_message({}), {})[0])
    assert wrong.type == "ProtocolError" and "served by the update class" in wrong.error


def test_adapter_store_is_atomic_and_reloads_once(tmp_path):
    events = []
    store = AdapterStore(tmp_path, commit=lambda: events.append("commit"), reload=lambda: events.append("reload"), keep=2)
    for version in range(4):
        store.write("p", version, {"adapter/a.bin": bytes([version]), "optimizer.pt": b"o"})
    assert store.versions("p") == [2, 3] and store.latest("p") == 3 and events == ["commit"] * 4
    assert store.read("p", 3) == {"adapter/a.bin": b"\x03", "optimizer.pt": b"o"} and events == ["commit"] * 4
    with pytest.raises(StorageNotFound, match="version 0 is not on the Modal Volume"):
        store.read("p", 0)
    assert events[-1] == "reload" and not list(tmp_path.glob("p/.tmp-*"))
    with pytest.raises(Exception, match="leaves its directory"):
        store.write("p", 9, {"../escape": b"x"})


# ---- ModalBackend -----------------------------------------------------------------------------
def _config(tiny_model, storage: Path, **changes) -> TrainConfig:
    base = TrainConfig(name="modal-test", model=tiny_model, reward=ascii_reward, tasks=make_task, steps=3, batch_size=2,
                       group_size=3, max_tokens=6, temperature=1.0, learning_rate=1e-2, checkpoint_every=2, seed=5,
                       progress=False, tis_cap=2.0, storage=str(storage), run_id="r")  # fmt: skip
    return base.replace(**changes)


def test_train_through_modal_backend_equals_local(tiny_model, tmp_path, fakes):
    expected = train(_config(tiny_model, tmp_path / "local"), backend="local")
    backend = ModalBackend(tiny_model, fakes, ModalConfig(), state_dir=str(tmp_path / "volume"), volume="",
                           engine="auto", micro_batch_size=16)  # fmt: skip
    got = train(_config(tiny_model, tmp_path / "modal"), backend=backend)
    for key in ("reward_mean", "loss", "sampled_tokens", "grad_norm", "policy_version"):
        assert [m[key] for m in got.metrics] == [m[key] for m in expected.metrics], key
    adapter = "runs/r/checkpoints/step-3/adapter/adapter_model.safetensors"
    assert (tmp_path / "modal" / adapter).read_bytes() == (tmp_path / "local" / adapter).read_bytes()
    # On-policy updates take their old log-probs from the update's own pass, so no forward call is needed.
    assert {m for _, m in fakes["rollout"].log} == {"rollout"} and {m for _, m in fakes["forward"].log} <= {"forward"}
    assert {"create_policy", "update", "save_state"} <= {m for _, m in fakes["update"].log}
    updates = sum(1 for m in got.metrics if m["trained_sequences"])
    assert backend.usage.calls()["rollout"] == 3 and backend.usage.calls()["update"] == updates
    assert all(s > 0 for s in backend.usage.seconds().values()) and backend.usage.device == "Modal L40S"
    assert got.usage and got.usage.get("device") == "Modal L40S"  # the run prices Modal's GPU
    [(policy, version)] = backend.versions.items()  # the run's one policy, at its last committed version
    assert policy.endswith("-default") and version == got.metrics[-1]["policy_version"]


def test_fan_out_splits_a_large_rollout_across_containers(tiny_model, tmp_path, fakes):
    local = LocalBackend(tiny_model)
    backend = ModalBackend(tiny_model, fakes, ModalConfig(tasks_per_container=2), state_dir=str(tmp_path), volume="")
    create = encode_message(CreatePolicyRequest("pol", LoraConfig(rank=4, seed=2)))
    local.call_bytes("create_policy", create)
    backend.call_bytes("create_policy", create)
    tasks = [{"prompt": f"count to {i}"} for i in range(5)]
    request = RolloutRequest("pol", tasks, 2, SamplingParams(max_tokens=5, temperature=1.0), EpisodeLimits(), seed=21,
                             reward=pack_code(ascii_reward))  # fmt: skip

    merged = decode_message(backend.call_bytes("rollout", encode_message(request)))
    chunks = split_rollout(request, 2)
    assert [offset for offset, _ in chunks] == [0, 2, 4] and [len(c.tasks) for _, c in chunks] == [2, 2, 1]
    assert [c.seed for _, c in chunks] == [21, chunk_seed(21, 1), chunk_seed(21, 2)] and chunk_seed(21, 0) == 21
    assert [kind for kind, _ in fakes["rollout"].log] == ["map"] * 3  # three fresh containers
    assert backend.usage.calls()["rollout"] == 3
    # The documented relation: the merged result is the chunk requests' results, concatenated in order.
    episodes = []
    for offset, chunk in chunks:
        part = decode_message(local.call_bytes("rollout", encode_message(chunk)))
        for episode in part.episodes:
            episode.task_index += offset
        episodes.extend(part.episodes)
    _assert_same(merged.episodes, episodes, "episodes")
    assert [e.task_index for e in merged.episodes] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert merged.stats["sampled_tokens"] == sum(e.mask.sum() for e in episodes)

    # A request that fits one container is sent unchanged and equals the local backend's.
    small = dataclasses.replace(request, tasks=tasks[:2])
    _assert_same(decode_message(backend.call_bytes("rollout", encode_message(small))),
                 decode_message(local.call_bytes("rollout", encode_message(small))), "small")  # fmt: skip
    assert fakes["rollout"].log[-1] == ("remote", "rollout")


# ---- the coordinator -------------------------------------------------------------------------
def test_coordinator_runs_and_resumes_from_its_volume_directory(built, tiny_model, tmp_path, monkeypatch, capsys):
    volume = tmp_path / "volume"
    settings = ModalConfig()
    monkeypatch.setattr(modal_app, "sibling_classes", lambda: {r: _LocalClasses(built.classes[r]) for r in ("rollout", "forward", "update")})
    monkeypatch.chdir(tmp_path)
    config = _config(tiny_model, Path("ignored-local-path"), steps=2, run_id=None, tis_cap=None)

    # The entrypoint of `modal run`: ships the config by value to the coordinator class.
    classes = {"coordinator": _LocalClasses(built.classes["coordinator"], "train", state_dir=str(volume))}
    first = run_on_modal(config, classes, settings, run_id="run-1")
    assert not first["resumed"] and [m["step"] for m in first["metrics"]] == [0, 1] and first["last_checkpoint_step"] == 2
    assert first["storage"] == str(volume)  # a local storage path becomes the Volume
    assert (volume / "runs/run-1/checkpoints/step-2/manifest.json").is_file()
    assert len((tmp_path / "runs/run-1/metrics.jsonl").read_text().splitlines()) == 2
    out = capsys.readouterr().out
    assert "run run-1 finished on Modal; last checkpoint step-2" in out and "--run-id run-1" in out
    assert "estimate for 2 steps" in out and "L40S" in out  # printed before the coordinator was called
    assert f"checkpoints: {volume}/runs/run-1/checkpoints" in out  # on Modal: a `modal volume get` command
    assert first["usage"]["by_function"]["rollout"]["calls"] == 2 and first["usage"]["device"] == "Modal L40S"

    # A new coordinator container (a retry, or `modal run ... --run-id run-1 --steps 3`) resumes.
    coordinator = built.classes["coordinator"](state_dir=str(volume))
    second = coordinator.train.local(ship_config(config.replace(steps=3)), "run-1", settings.to_json())
    assert second["resumed"] and [m["step"] for m in second["metrics"]] == [0, 1, 2]
    assert second["metrics"][:2] == first["metrics"][:2] and second["last_checkpoint_step"] == 3
    state = json.loads((volume / "runs/run-1/state.json").read_text())
    assert state["status"] == "finished" and state["step"] == 3


def broken_reward(completion: str, task: dict) -> float:
    raise ValueError("no score")


def test_a_user_error_in_the_coordinator_comes_back_typed_without_retries(built, tiny_model, tmp_path, monkeypatch):
    from tinkerless.errors import EnvError

    monkeypatch.setattr(modal_app, "sibling_classes", lambda: {r: _LocalClasses(built.classes[r]) for r in ("rollout", "forward", "update")})
    monkeypatch.chdir(tmp_path)
    volume = str(tmp_path / "volume")
    config = _config(tiny_model, Path("."), steps=1, run_id=None, reward=broken_reward)
    # Returned, not raised: Modal retries a raised error, and a broken reward fails the same way every time.
    result = built.classes["coordinator"](state_dir=volume).train.local(ship_config(config), "bad", ModalConfig().to_json())
    assert result["error"]["type"] == "EnvError" and "6 of 6 episodes failed" in result["error"]["message"]
    coordinator = _LocalClasses(built.classes["coordinator"], "train", state_dir=volume)
    with pytest.raises(EnvError, match="run bad-2 on Modal: 6 of 6 episodes failed") as info:
        run_on_modal(config, {"coordinator": coordinator}, ModalConfig(), run_id="bad-2")
    assert "fix the env/reward" in info.value.hint


def test_frozen_adapters_on_this_machine_are_refused_before_shipping(tiny_model, tmp_path):
    import tinkerless
    from tinkerless.envs.gomoku import GomokuEnv

    config = TrainConfig(model=tiny_model, env=GomokuEnv, tasks=[{}],
                         agents={"black": "p", "white": tinkerless.Frozen(str(tmp_path))})  # fmt: skip
    with pytest.raises(ConfigError, match="not on the Modal Volume"):
        ship_config(config)


# ---- credentials -----------------------------------------------------------------------------
def test_missing_token_is_a_clear_config_error_and_fails_fast(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env.update(HOME=str(tmp_path), MODAL_CONFIG_PATH=str(tmp_path / ".modal.toml"))  # no ~/.modal.toml, no token
    code = textwrap.dedent(
        """
        import sys, time
        from tinkerless.cloud.modal_backend import make_modal_backend
        started = time.perf_counter()
        try:
            make_modal_backend(sys.argv[1])
        except Exception as exc:
            print(type(exc).__name__, round(time.perf_counter() - started, 3))
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code, tiny_model], env=env, check=False, capture_output=True, text=True, timeout=120)
    first, _, message = out.stdout.partition("\n")
    kind, seconds = first.split()
    assert kind == "ConfigError", out.stdout + out.stderr
    assert float(seconds) < 5  # Modal refuses at once; nothing waits on the network
    assert "modal token new" in message and "MODAL_TOKEN_ID" in message


# ---- examples ----------------------------------------------------------------------------------
def test_examples_expose_a_modal_app_and_still_train_locally(tiny_model, tmp_path):
    from tinkerless.sdk.cli.commands import load_config

    config = load_config(str(REPO / "examples/arithmetic.py"))  # modal is imported here, as under `modal run`
    app = sys.modules["arithmetic"].app
    assert isinstance(app, modal.App)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert list(app.registered_entrypoints) == ["main"]
        assert set(app.registered_classes) == {"Rollout", "Forward", "Update", "Coordinator"}
    result = train(config.replace(model=tiny_model, steps=1, batch_size=2, group_size=2, max_tokens=4,
                                  storage=str(tmp_path), progress=False))  # fmt: skip
    assert len(result.metrics) == 1


def test_examples_import_without_modal_for_tinkerless_train():
    code = textwrap.dedent(
        """
        import sys
        import tinkerless, tinkerless.cloud.modal_config, tinkerless.cloud.modal_backend, tinkerless.cloud.modal_entry
        assert "modal" not in sys.modules, "importing tinkerless must not import modal"
        from tinkerless.sdk.cli.commands import load_config
        for path in sys.argv[1:]:
            config = load_config(path)
            module = sys.modules[path.rsplit("/", 1)[-1][:-3]]
            assert module.app is None and config is not None, path
        assert "modal" not in sys.modules, "tinkerless train must not import modal"
        print("ok", len(sys.argv) - 1)
        """
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, EXAMPLES)], check=False, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == f"ok {len(EXAMPLES)}", out.stdout + out.stderr


def test_modal_cli_finds_the_example_entrypoint_and_refuses_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    env.update(HOME=str(tmp_path), MODAL_CONFIG_PATH=str(tmp_path / ".modal.toml"))
    command = [sys.executable, "-m", "modal", "run", str(REPO / "examples/arithmetic.py")]
    usage = subprocess.run([*command, "--help"], env=env, check=False, capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "--steps" in usage.stdout and "--run-id" in usage.stdout, usage.stdout + usage.stderr
    refused = subprocess.run([*command, "--steps", "1"], env=env, check=False, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "modal token new" in refused.stdout + refused.stderr


def test_a_reader_proves_each_version_it_loads_against_the_writers_proof(built, tiny_model, tmp_path):
    """Issue #26's hand-off check on Modal's readers: the writer commits a proof with each version; a reader whose
    copy of the files, or whose loaded weights, differ from it refuses to serve, naming policy, version and values."""
    from tinkerless.functions.handoff import PROOF_FILE, VersionProof

    params = {"model": tiny_model, "state_dir": str(tmp_path)}
    update = built.classes["update"](**params)
    update.call.local("create_policy", encode_message(CreatePolicyRequest("pol", LoraConfig(rank=4, seed=3))), {})
    tokens = np.arange(5, 17, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    step = UpdateRequest("pol", [Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)], LossConfig(),
                         AdamParams(learning_rate=5e-2))
    assert decode_message(update.call.local("update", encode_message(step), {"pol": 0})[0]).policy_version == 1
    version_dir = tmp_path / "adapters" / model_key(tiny_model) / "pol" / "v1"
    proof = VersionProof.from_bytes((version_dir / PROOF_FILE).read_bytes())
    assert (proof.policy, proof.version, len(proof.probe_logprobs)) == ("pol", 1, len(proof.probe_tokens) - 1)
    request = encode_message(ForwardRequest("pol", [Datum(tokens, ones)]))

    def read(versions: dict) -> object:
        return decode_message(built.classes["forward"](**params).call.local("forward", request, versions)[0])

    assert not isinstance(read({"pol": 1}), ErrorReply)  # the proof holds: served
    weights = version_dir / "adapter" / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-4] + b"\x00\x00\x80\x7f")  # a torn or stale copy of the files
    reply = read({"pol": 1})
    assert isinstance(reply, ErrorReply) and reply.type == "WeightSyncError"
    assert "'pol' version 1" in reply.error and "hash to" in reply.error and proof.adapter_sha256[:16] in reply.error
    weights.write_bytes(good)
    wrong = VersionProof(proof.policy, 1, proof.adapter_sha256, proof.probe_tokens,
                         [v + 0.5 for v in proof.probe_logprobs], proof.dtype)
    (version_dir / PROOF_FILE).write_bytes(wrong.to_bytes())  # files intact, but the weights would not reproduce it
    reply = read({"pol": 1})
    assert isinstance(reply, ErrorReply) and reply.type == "WeightSyncError" and "probe" in reply.error
    assert "differ from the writer's by 0.5" in reply.error
    (version_dir / PROOF_FILE).unlink()  # a Volume written before proofs existed: its versions load as before
    assert not isinstance(read({"pol": 1}), ErrorReply)


@pytest.mark.parametrize("which", ["same vocabulary", "other vocabulary"])
def test_a_teacher_of_another_base_runs_in_a_forward_class_of_its_own(tiny_model, tmp_path, fakes, which):
    """teacher=<another base> on Modal: a Forward class parameterized with the teacher's model scores the samples,
    the client aligns with the tokenizers the containers loaded, and the run ends with the local backend's second-
    model teacher's adapter, bit for bit; the teacher's GPU-seconds are the run's own `teacher` line."""
    from conftest import build_other_vocabulary_model

    from tinkerless.functions.models import build_tiny_model

    if which == "same vocabulary":
        teacher = build_tiny_model(tmp_path / "teacher", hidden_size=64, num_layers=2, seed=1, initializer_range=0.2)
    else:
        teacher = build_other_vocabulary_model(tmp_path / "teacher")
    settings = dict(teacher=teacher, steps=1, checkpoint_every=1)
    expected = train(_config(tiny_model, tmp_path / "local").replace(**settings), backend="local")
    backend = ModalBackend(tiny_model, fakes, ModalConfig(), state_dir=str(tmp_path / "volume"), volume="",
                           engine="auto", micro_batch_size=16)  # fmt: skip
    got = train(_config(tiny_model, tmp_path / "modal").replace(**settings), backend=backend)
    for key in ("teacher_logprob_gap", "teacher_aligned_share", "teacher_aligned_tokens", "loss", "reward_mean"):
        assert got.metrics[0][key] == expected.metrics[0][key], key
    assert abs(got.metrics[0]["teacher_logprob_gap"]) > 1e-3
    adapter = "runs/r/checkpoints/step-1/adapter/adapter_model.safetensors"
    assert (tmp_path / "modal" / adapter).read_bytes() == (tmp_path / "local" / adapter).read_bytes()
    forwards = [m for m, (_, method) in zip(fakes["forward"].models, fakes["forward"].log) if method == "forward"]
    assert forwards and set(forwards) == {teacher}  # every teacher forward went to the teacher's Forward class
    assert got.usage["compute_seconds"]["teacher"] > 0 and got.usage["by_function"]["teacher/forward"]["calls"] == 1
    with pytest.raises(Exception, match="answers forward only"):
        from tinkerless.sdk.backends.base import call

        call(backend.served_model(teacher), "sample", {})
