"""The boundary validation (tinkerless/wire/validate.py) over the whole class: every numeric field of
every request type, not only the examples the issue names."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np
import pytest

from tinkerless.errors import InvalidRequest
from tinkerless.functions.losses import LossConfig
from tinkerless.wire import PYTHON_VERSION, decode_message, encode_message
from tinkerless.wire.code import CodeBlob
from tinkerless.wire.messages import (
    AdamParams, CreatePolicyRequest, Datum, EpisodeLimits, ForwardBackwardRequest, ForwardRequest, LoadStateRequest,
    LoraConfig, MultiAgentRolloutRequest, OptimStepRequest, PolicyState, ResetPolicyRequest, RolloutRequest,
    SampleRequest, SamplingParams, SaveStateRequest, Seat, UpdateRequest,
)
from tinkerless.wire.runs import CheckpointPolicy, RestoreCheckpointRequest, RunListRequest, SaveCheckpointRequest
from tinkerless.wire.run_calls import run_call_args
from tinkerless.wire.validate import MAX_DEPTH, validate

VOCAB = 100


def _datum() -> Datum:
    ones = np.ones(4, np.float32)
    return Datum(np.array([1, 2, 3, 4], np.int32), ones, advantages=ones, sampler_logprobs=-ones)


def _nested(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def valid_requests() -> list:
    sampling = SamplingParams(max_tokens=4)
    blob = CodeBlob("env", PYTHON_VERSION, b"x")
    policies = [CheckpointPolicy("default", "", "pol")]
    return [
        CreatePolicyRequest("pol", LoraConfig(rank=4)), ResetPolicyRequest("pol"),
        RolloutRequest("pol", [{"prompt": "a"}], 2, sampling, EpisodeLimits(), 3),
        MultiAgentRolloutRequest([{}], 1, blob, {"a": Seat("pol")}, sampling, EpisodeLimits(), 0),
        SampleRequest("pol", [[1, 2], "text"], 2, sampling, 5), ForwardRequest("pol", [_datum()]),
        ForwardBackwardRequest("pol", [_datum()], LossConfig()), OptimStepRequest("pol", AdamParams()),
        UpdateRequest("pol", [_datum()], LossConfig(), AdamParams()), SaveStateRequest("pol"),
        LoadStateRequest(PolicyState("pol", {"adapter/x": b""})),
        SaveCheckpointRequest("run", "lease", 2, policies, {"client.json": b"{}"}, {"a": [1]}, 3),
        RestoreCheckpointRequest("run", None, policies, ["client.json"]), RunListRequest(None),
    ]


def _numeric_fields(value, path=()):
    """(path, annotation) of every int and float field reachable through dataclasses."""
    hints = typing.get_type_hints(type(value))
    for f in dataclasses.fields(value):
        child = getattr(value, f.name)
        if dataclasses.is_dataclass(child):
            yield from _numeric_fields(child, path + (f.name,))
        elif isinstance(child, list) and child and dataclasses.is_dataclass(child[0]):
            yield from _numeric_fields(child[0], path + (f.name, 0))
        elif hints[f.name] in (int, float):
            yield path + (f.name,), hints[f.name]


def _with(request, path, new):
    request = decode_message(encode_message(request))  # a fresh copy, as the server would decode it
    parent = request
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    object.__setattr__(parent, path[-1], new)
    return request


CASES = [(r, p, h) for r in valid_requests() for p, h in _numeric_fields(r)]


def test_the_valid_requests_pass():
    for request in valid_requests():
        validate(request, vocab_size=VOCAB)


@pytest.mark.parametrize("request_, path, hint", CASES, ids=[f"{type(r).__name__}.{'.'.join(map(str, p))}" for r, p, _ in CASES])
def test_every_numeric_field_refuses_non_finite_and_wrong_types(request_, path, hint):
    bad = [float("nan"), float("inf"), -float("inf"), "1", None, [1], True]
    if hint is int:
        bad += [1.5, 2.0]
    for value in bad:
        with pytest.raises(InvalidRequest) as info:
            validate(_with(request_, path, value), vocab_size=VOCAB)
        assert info.value.category == "user" and path[-1] in info.value.message


@pytest.mark.parametrize("field, value", [
    ("learning_rate", -1.0), ("beta1", 5.0), ("beta1", 1.0), ("beta2", -0.1), ("eps", 0.0), ("weight_decay", -1.0),
])
def test_adam_ranges(field, value):
    with pytest.raises(InvalidRequest, match=field):
        validate(OptimStepRequest("pol", dataclasses.replace(AdamParams(), **{field: value})))


@pytest.mark.parametrize("change", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": 101.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1},
    {"top_k": VOCAB + 1}, {"max_tokens": -1}, {"max_tokens": 2**40}, {"stop_token_ids": [VOCAB]},
])
def test_sampling_ranges(change):
    with pytest.raises(InvalidRequest):
        validate(SampleRequest("pol", [[1]], 1, dataclasses.replace(SamplingParams(), **change)), vocab_size=VOCAB)


@pytest.mark.parametrize("request_", [
    CreatePolicyRequest("pol", LoraConfig(rank=0)), CreatePolicyRequest("pol", LoraConfig(rank=-1)),
    CreatePolicyRequest("pol", LoraConfig(rank=257)), CreatePolicyRequest("p" * 256), CreatePolicyRequest("bad/name"),
    CreatePolicyRequest("base"), CreatePolicyRequest("pol", LoraConfig(seed=-1)),
    CreatePolicyRequest("pol", LoraConfig(target_modules=[])),
    SampleRequest("pol", [[1, VOCAB]]), SampleRequest("pol", []), SampleRequest("pol", [[1]], num_samples=0),
    SampleRequest("pol", [[1]], seed=2**63), RolloutRequest("pol", [{}], 0, SamplingParams(), EpisodeLimits(), 0),
    ForwardRequest("pol", [Datum(np.array([1, -1], np.int32), np.ones(2, np.float32))]),
    ForwardRequest("pol", [Datum(np.array([1, 2], np.int32), np.ones(3, np.float32))]),
    ForwardRequest("pol", [Datum(np.array([1, 2], np.int32), np.array([1, np.nan], np.float32))]),
    ForwardRequest("pol", [Datum(np.array([1.0, 2.0]), np.ones(2, np.float32))]),
    ForwardBackwardRequest("pol", [_datum()], loss=5), ForwardBackwardRequest("pol", [], LossConfig()),
    UpdateRequest("base", [_datum()], LossConfig()), ForwardBackwardRequest("pol", [_datum()], LossConfig(name="nope")),
    RolloutRequest("pol", [{"a": _nested(MAX_DEPTH)}], 1, SamplingParams(), EpisodeLimits(), 0),
    SaveCheckpointRequest("run", "lease", -1, []), RestoreCheckpointRequest("run", None, [], [], keep_last=0),
])
def test_out_of_range_and_malformed_requests(request_):
    with pytest.raises(InvalidRequest) as info:
        validate(request_, vocab_size=VOCAB)
    assert info.value.category == "user" and info.value.hint


def test_nesting_is_bounded_without_recursing_past_it():
    deep = _nested(5000)  # far past Python's recursion limit: the check stops at MAX_DEPTH
    with pytest.raises(InvalidRequest, match=f"more than {MAX_DEPTH} levels"):
        validate(RolloutRequest("pol", [{"a": deep}], 1, SamplingParams(), EpisodeLimits(), 0))


def test_integers_in_float_fields_become_floats():
    request = validate(OptimStepRequest("pol", AdamParams(learning_rate=1, beta1=0)))
    assert isinstance(request.adam.learning_rate, float) and isinstance(request.adam.beta1, float)


@pytest.mark.parametrize("method, args", [
    ("wait_rollouts", {"step": 0, "timeout": float("nan")}), ("wait_rollouts", {"step": 0, "timeout": -1}),
    ("wait_rollouts", {"timeout": 1.0}), ("begin_update", {"step": "0"}), ("begin_update", {"step": True}),
    ("begin_update", {"step": 1.0}), ("begin_rollout", {"step": 0, "participants": "default"}),
    ("begin_rollout", {"step": 0, "participants": []}), ("submit_rollout", {"step": 0, "participant": 5}),
    ("commit_update", {"step": 0, "metrics": [1]}), ("finish", {"status": "done"}), ("finish", {"status": ["x"]}),
    ("create", {"config": "x"}), ("begin_update", {"step": 0, "extra": 1}), ("nope", {}), ("state", []),
])
def test_run_call_arguments(method, args):
    with pytest.raises(InvalidRequest):
        run_call_args(method, args)


def test_run_ids_refuse_a_trailing_newline():
    from tinkerless.coordinator.state import validate_run_id
    from tinkerless.errors import UserError

    assert validate_run_id("run-1") == "run-1"
    for bad in ("run\n", "run\r\n", "\nrun", "a" * 129, "../x", ""):
        with pytest.raises(UserError):
            validate_run_id(bad)


def test_a_bad_policy_state_is_refused_and_leaves_the_policy_untouched(worker):
    from tinkerless.errors import UserError

    worker.create_policy(CreatePolicyRequest("keepme", LoraConfig(rank=2)))
    good = worker.save_state(SaveStateRequest("keepme")).files
    other_rank = dict(good)
    worker.create_policy(CreatePolicyRequest("rank4", LoraConfig(rank=4)))
    other_rank["adapter/adapter_model.safetensors"] = worker.save_state(SaveStateRequest("rank4")).files[
        "adapter/adapter_model.safetensors"
    ]
    broken = [
        {},
        {**good, "adapter/adapter_config.json": b"[]"},
        {**good, "adapter/adapter_config.json": b'{"r": 0}'},
        {**good, "adapter/adapter_config.json": b"not json"},
        {**good, "adapter/adapter_model.safetensors": b"garbage"},
        {**good, "optimizer.pt": b"garbage"},
        {**good, "optimizer.pt": good["worker_rng.pt"]},  # a torch file, but not an optimizer state
        {**good, "worker_rng.pt": b"\x80\x04garbage"},
        other_rank,  # weights of another shape
    ]
    for files in broken:
        with pytest.raises(UserError):
            worker.load_state(LoadStateRequest(PolicyState("keepme", files, 7)))
        assert worker.save_state(SaveStateRequest("keepme")).files["adapter/adapter_model.safetensors"] == good[
            "adapter/adapter_model.safetensors"
        ]
        assert worker.policies["keepme"].version == 0
    # A bad state for a policy that does not exist yet leaves no half-made policy behind.
    with pytest.raises(UserError):
        worker.load_state(LoadStateRequest(PolicyState("newone", other_rank | {
            "adapter/adapter_config.json": good["adapter/adapter_config.json"]}, 1)))
    assert "newone" not in worker.policies
