"""Several GPUs per role on Modal and SkyPilot (issue #27), offline: `gpu="H100:4"` in ModalConfig, the Modal
app's Update class with two GPUs run through `.local()` as two CPU ranks, the sky task files with
`accelerators: X:N`, and the memory preflight that refuses a model its GPUs cannot hold before anything starts.
No test sets a Modal token; SkyPilot's API server is never contacted (test_sky's fixtures)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load as load_safetensors

from tinkerless.cloud.modal_config import ClassSpec, ModalConfig
from tinkerless.cloud.preflight import check_modal, check_sky, parse_accelerators
from tinkerless.errors import ConfigError
from tinkerless.functions.memory_plan import ModelShape
from tinkerless.functions.scaling_table import LADDER

modal = pytest.importorskip("modal")
from test_sky import FakeSky, sky, tl_home  # noqa: E402,F401  (fixtures: SkyPilot offline, a per-test key home)

from tinkerless.cloud import modal_app  # noqa: E402
from tinkerless.cloud.modal_backend import role_options  # noqa: E402
from tinkerless.cloud.modal_volume import model_key  # noqa: E402
from tinkerless.cloud.sky_backend import key_file, make_sky_backend  # noqa: E402
from tinkerless.cloud.sky_tasks import SKY_DIR  # noqa: E402
from tinkerless.functions.handoff import PROOF_FILE  # noqa: E402
from tinkerless.functions.losses import LossConfig  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.wire import decode_message, encode_message  # noqa: E402
from tinkerless.wire.messages import (  # noqa: E402
    AdamParams,
    CreatePolicyRequest,
    Datum,
    ForwardRequest,
    LoraConfig,
    SaveStateRequest,
    UpdateRequest,
)

pytestmark = pytest.mark.filterwarnings("ignore:The .* function is executing locally:UserWarning")


# ---- configuration -------------------------------------------------------------------------
def test_modal_takes_type_colon_count_up_to_each_types_maximum():
    config = ModalConfig(update=ClassSpec(gpu="H100:4"))
    assert (config.update.gpu, config.update.gpu_count, config.update.gpu_request()) == ("H100", 4, "H100:4")
    assert ModalConfig.from_json(config.to_json()) == config
    assert ModalConfig.from_env({"TINKERLESS_MODAL_UPDATE_GPU": "A100-80GB:8"}).update.gpu_request() == "A100-80GB:8"
    assert ModalConfig().replace(update={"gpu": "L40S:2"}).update.cls_options()["gpu"] == "L40S:2"
    for gpu, message in (("A10G:8", "gpu_count must be 1..4 for A10G"), ("H100:9", "gpu_count must be 1..8 for H100"),
                         ("H100:two", "must be a whole number"), ("V100:2", "unknown GPU type 'V100'")):  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            ModalConfig().replace(update={"gpu": gpu})
    with pytest.raises(ConfigError, match="disagree"):
        ClassSpec(gpu="H100:4", gpu_count=2)
    # Several GPUs: ranks for the update and forward roles, vLLM's tensor parallelism for the rollout role.
    spec = ClassSpec(gpu="H100:4")
    assert role_options("update", spec, {"engine": "auto"}) == {"engine": "auto", "ranks": 4}
    assert role_options("rollout", spec, {}) == {"tensor_parallel_size": 4}
    assert role_options("forward", ClassSpec(gpu="H100"), {"dtype": "bf16"}) == {"dtype": "bf16"}


# ---- the Modal app: an Update class with two GPUs, as two CPU ranks -----------------------------
def _data() -> list[Datum]:
    rng = np.random.default_rng(1)
    out = []
    for n in (6, 11, 9, 14, 5):
        tokens = rng.integers(0, 250, n).astype(np.int32)
        mask = np.zeros(n, np.float32)
        mask[n // 2 :] = 1
        out.append(Datum(tokens, mask, advantages=mask * 0.5, sampler_logprobs=np.full(n, -1.0, np.float32)))
    return out


def test_a_two_gpu_update_class_trains_over_two_ranks_through_local(tiny_model, tmp_path):
    config = ModalConfig(update=ClassSpec(gpu="H100:2"), forward=ClassSpec(gpu="H100:2"))
    built = modal_app.build_app(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # registered_functions is deprecated in modal 1.6, still the public view
        info = built.app.registered_functions["Update.*"].info()
    assert info.gpus == [("H100", 2)]
    params = {"model": tiny_model, "state_dir": str(tmp_path)}
    update = built.classes["update"](**params, options=json.dumps(role_options("update", config.update, {})))
    lora, adam = LoraConfig(rank=4, alpha=8, seed=5), AdamParams(learning_rate=1e-2)

    def call(obj, method, request, versions):
        reply = decode_message(obj.call.local(method, encode_message(request), versions)[0])
        assert not hasattr(reply, "error"), reply
        return reply

    assert call(update, "info", {}, {})["ranks"] == 2  # the container's worker is two ranks
    call(update, "create_policy", CreatePolicyRequest("pol", lora), {})
    assert call(update, "update", UpdateRequest("pol", _data(), LossConfig(), adam), {"pol": 0}).policy_version == 1
    # The same step in one process: the same adapter, to float tolerance; the writer published it with its proof.
    single = Worker(tiny_model)
    single.create_policy(CreatePolicyRequest("pol", lora))
    single.update(UpdateRequest("pol", _data(), LossConfig(), adam))
    expected = load_safetensors(single.save_state(SaveStateRequest("pol")).files["adapter/adapter_model.safetensors"])
    version_dir = tmp_path / "adapters" / model_key(tiny_model) / "pol" / "v1"
    published = load_safetensors((version_dir / "adapter" / "adapter_model.safetensors").read_bytes())
    for key, value in expected.items():
        torch.testing.assert_close(published[key], value, atol=1e-6, rtol=1e-5)
    assert (version_dir / PROOF_FILE).is_file()
    # A two-rank forward reader loads the committed version and checks it against the writer's proof.
    forward = built.classes["forward"](**params, options=json.dumps(role_options("forward", config.forward, {})))
    got = call(forward, "forward", ForwardRequest("pol", _data()), {"pol": 1})
    ours = single.forward(ForwardRequest("pol", _data()))
    for a, b in zip(got.logprobs, ours.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_run_fans_rollouts_out_over_containers_while_two_ranks_train(tiny_model, tmp_path):
    """Data-parallel sampling (the rollout class's fan-out over containers) beside a two-GPU update class: the
    run trains as it does with a one-GPU update class, to float tolerance."""
    from test_modal import _config, _LocalClasses

    from tinkerless.cloud.modal_backend import ModalBackend
    from tinkerless.sdk.run.trainer import train

    def run(config: ModalConfig, name: str):
        built = modal_app.build_app(config)
        fakes = {role: _LocalClasses(built.classes[role]) for role in ("rollout", "forward", "update")}
        backend = ModalBackend(tiny_model, fakes, config, state_dir=str(tmp_path / name / "volume"), volume="",
                               engine="auto", micro_batch_size=16)  # the options every role's Worker gets
        result = train(_config(tiny_model, tmp_path / name, steps=2, batch_size=3), backend=backend)
        assert [kind for kind, _ in fakes["rollout"].log].count("map") == 4  # 3 tasks in chunks of 2, each step
        return result

    expected = run(ModalConfig(tasks_per_container=2), "one-gpu")
    got = run(ModalConfig(tasks_per_container=2).replace(update={"gpu": "L40S:2"}), "two-gpus")
    for key in ("reward_mean", "loss", "grad_norm", "policy_version"):
        assert [m[key] for m in got.metrics] == pytest.approx([m[key] for m in expected.metrics], rel=1e-4, abs=1e-6), key


# ---- the memory preflight ----------------------------------------------------------------------
def big_model(tmp_path: Path, name: str = "70B") -> str:
    """A directory with only the config.json of a large shape: enough to plan, nothing to load."""
    shape = LADDER[name]
    directory = tmp_path / f"model-{name}"
    directory.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": shape.hidden,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "intermediate_size": shape.intermediate,
              "vocab_size": shape.vocab, "tie_word_embeddings": shape.tied}  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    assert ModelShape.of(str(directory)) == shape
    return str(directory)


def test_modal_refuses_a_model_its_gpus_cannot_hold_before_starting_anything(tmp_path, monkeypatch):
    model = big_model(tmp_path)
    with pytest.raises(ConfigError) as error:
        check_modal(model, ModalConfig().replace(gpu="H100"))
    assert "modal rollout" in error.value.message and "131.4 GiB in bf16" in error.value.message
    assert "vLLM" in error.value.hint
    # The update over 4 H100s fits; its sampler still needs vLLM's tensor parallelism over the rollout's GPUs.
    check_modal(model, ModalConfig(extras=("vllm",)).replace(gpu="H100:4"))
    with pytest.raises(ConfigError, match="modal update \\(gpu='H100'\\)") as error:
        check_modal(model, ModalConfig(extras=("vllm",)).replace(gpu="H100:4").replace(update={"gpu": "H100", "gpu_count": 1}))
    assert "'H100:2'" in error.value.hint and "H200" in error.value.hint
    # make_modal_backend refuses before it builds or starts the App (no Modal client, no token needed).
    from tinkerless.cloud import modal_backend

    def no_app(*args, **kwargs):
        raise AssertionError("the App was built: the preflight must refuse first")

    monkeypatch.setattr(modal_app, "build_app", no_app)
    with pytest.raises(ConfigError, match="does not fit|needs at least"):
        modal_backend.make_modal_backend(model, config=ModalConfig().replace(gpu="L4"))


def test_sky_task_files_take_accelerators_type_colon_count(sky, tmp_path):
    for path in sorted(SKY_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        raw["resources"]["accelerators"] = "H100:4"
        copy = tmp_path / path.name
        copy.write_text(yaml.safe_dump(raw))
        task = sky.Task.from_yaml(str(copy))
        assert {tuple(r.accelerators.items()) for r in task.resources} == {(("H100", 4),)}, path.name
        assert '--gpus "${SKYPILOT_NUM_GPUS_PER_NODE:-1}"' in task.run, path.name  # every GPU of the node trains


def test_sky_drops_gpu_options_the_model_cannot_fit_and_refuses_when_none_can(sky, tl_home, tmp_path, monkeypatch):
    assert parse_accelerators({"L4": 1, "H100": None}) == {"L4": 1, "H100": 1}
    assert parse_accelerators("A100-80GB:8") == {"A100-80GB": 8} and parse_accelerators(["T4", "L4:2"]) == {"T4": 1, "L4": 2}
    eight = big_model(tmp_path, "8B")  # 15 GiB in bf16: not a T4 (fp32 there), fine on the larger cards
    assert check_sky(eight, {"T4": 1, "L4": 1, "A100": 1, "H100": 1, "RTX4090": 1}) == {"L4": 1, "A100": 1, "H100": 1,
                                                                                      "RTX4090": 1}  # fmt: skip
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    with pytest.raises(ConfigError, match="no GPU option of the task \\(L4:1, A10G:1, L40S:1, A100:1, H100:1\\)") as error:
        make_sky_backend(big_model(tmp_path, "70B"), cluster="tl-big")
    assert "'H100:2'" in error.value.hint
    assert "launch" not in fake.names() and not key_file("tl-big").exists()  # nothing launched, no key kept


def test_the_vllm_engine_splits_the_model_over_the_gpus_it_is_given(monkeypatch):
    """`tensor_parallel_size` reaches vLLM's `LLM` (a model too large for one GPU samples over several)."""
    import sys
    import types

    from tinkerless.functions.sampling import vllm_engine

    made = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kwargs: made.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    vllm_engine.VLLMEngine("/models/m", lambda policy: None, **vllm_parallel_kwargs(4))
    assert made["tensor_parallel_size"] == 4 and made["enable_lora"] is True
    vllm_engine.VLLMEngine("/models/m", lambda policy: None, **vllm_parallel_kwargs(1))
    assert made["tensor_parallel_size"] == 1


def vllm_parallel_kwargs(size: int) -> dict:
    from tinkerless.functions.memory_plan import vllm_parallel

    return vllm_parallel(size)
