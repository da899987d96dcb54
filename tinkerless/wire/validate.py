"""Validation of every wire type a client sends: types, finiteness and ranges, in one place.

`validate(request)` walks a decoded request: each dataclass field is checked against its
annotation (an `int` is never a bool or a float, a `float` is finite, a `list[int]` holds
ints, ...), then against the ranges in `_RULES` for that class. Plain data (`tasks`,
metadata, run-call arguments) must be JSON-like and at most `MAX_DEPTH` levels deep, so
nothing later recurses into a hostile nesting. `run_calls.run_call_args` does the same for the
arguments of each coordinator call.

The server calls these at its boundary (`Worker.handle`, the run routes, the Tinker routes)
before any value reaches the model, the optimizer or storage: a caller's mistake is an
`InvalidRequest` (HTTP 400, category "user") naming the field, never a 500 later on.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable

import numpy as np

from tinkerless.errors import InvalidRequest, TinkerlessError
from tinkerless.wire.value_rules import between, bounded_text as _bounded_text, endpoint_url as _endpoint_url
from tinkerless.wire.value_rules import fail as _fail, non_empty as _non_empty, one_of as _one_of, tagged as _tagged
from tinkerless.wire.content import check_request_images
from tinkerless.storage.names import POLICY_NAME, RUN_ID, check_file_key, check_name
from tinkerless.wire.tasks import check_single_turn_tasks

MAX_DEPTH = 32  # nesting of plain data (tasks, metadata); real requests use a handful of levels
MAX_SEED = 2**63 - 1
# Sanity ceilings only (nothing legitimate comes near them); the server's configurable per-request
# limits on tokens and samples are stricter and apply on top.
MAX_TOKENS = 1 << 20
MAX_COUNT = 1 << 16
MAX_STEP = 2**31 - 1  # steps and policy versions: far past any run, and safe in every int type downstream
# Adam moves each weight by about the learning rate a step: past this, a few steps overflow the adapter to inf.
MAX_LEARNING_RATE = 10.0


# ---- generic checks against the annotations -------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _check_number(value: Any, kind: type, path: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        _fail(path, f"must be a{'n integer' if kind is int else ' number'}, got {type(value).__name__}")
    if kind is int and not isinstance(value, (int, np.integer)):
        _fail(path, f"must be an integer, got {value!r}")
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        _fail(path, f"must be a finite number, got {value!r}")


def _check_plain(value: Any, path: str, depth: int) -> None:
    """JSON-like data (and arrays, dataclasses inside it), at most MAX_DEPTH levels deep."""
    if depth > MAX_DEPTH:
        _fail(path, f"is nested more than {MAX_DEPTH} levels deep", "send flatter data")
    if value is None or isinstance(value, (str, bool, bytes, np.ndarray)):
        return
    if isinstance(value, (int, float, np.integer, np.floating)):
        _check_number(value, float, path)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                _fail(path, f"has a key of type {type(key).__name__}; keys must be strings")
            _check_plain(item, f"{path}[{key!r}]", depth + 1)
    elif dataclasses.is_dataclass(value):
        _check(value, Any, path, depth + 1)
    else:
        _fail(path, f"holds a {type(value).__name__}, which is not plain data")


def check_json_object(value: Any, path: str, depth: int = 0) -> None:
    """Data that is written as JSON (a checkpoint's metadata, a run's config, metrics and summary): maps with
    string keys only (JSON has no other; a map mixing int and str keys cannot even be sorted), of plain values."""
    if depth > MAX_DEPTH:
        _fail(path, f"is nested more than {MAX_DEPTH} levels deep", "send flatter data")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                _fail(path, f"has a key of type {type(key).__name__} ({str(key)[:20]!r}); JSON keys are strings")
            check_json_object(item, f"{path}[{key!r}]", depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_json_object(item, f"{path}[{i}]", depth + 1)
    elif isinstance(value, (bytes, np.ndarray)) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        _fail(path, f"holds a {type(value).__name__}, which JSON cannot hold", "send numbers, strings, lists and maps")
    else:
        _check_plain(value, path, depth)


def _check(value: Any, hint: Any, path: str, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        _fail(path, f"is nested more than {MAX_DEPTH} levels deep", "send flatter data")
    origin = typing.get_origin(hint)
    if hint is Any:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_dataclass(value, path, depth)
        else:
            _check_plain(value, path, depth)
    elif origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _check(value, option, path, depth)
            except InvalidRequest as exc:
                errors.append(exc.message)
        _fail(path, f"has the wrong type ({'; or '.join(errors)})")
    elif hint in (int, float):
        _check_number(value, hint, path)
    elif hint in (str, bytes, bool):
        if not isinstance(value, hint) or (hint is not bool and isinstance(value, bool)):
            _fail(path, f"must be a {hint.__name__}, got {type(value).__name__}")
    elif hint in (dict, list):
        if not isinstance(value, hint):
            _fail(path, f"must be a {'map' if hint is dict else 'list'}, got {type(value).__name__}")
        _check_plain(value, path, depth)
    elif hint is np.ndarray:
        if not isinstance(value, np.ndarray):
            _fail(path, f"must be an array, got {type(value).__name__}")
    elif origin is list:
        if not isinstance(value, list):
            _fail(path, f"must be a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint) or (Any,)
        for i, element in enumerate(value):
            _check(element, item, f"{path}[{i}]", depth + 1)
    elif origin is dict:
        if not isinstance(value, dict):
            _fail(path, f"must be a map, got {type(value).__name__}")
        key_hint, item_hint = typing.get_args(hint) or (str, Any)
        for key, element in value.items():
            _check(key, key_hint, f"{path} key", depth + 1)
            _check(element, item_hint, f"{path}[{key!r}]", depth + 1)
    elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            _fail(path, f"must be a {hint.__name__}, got {type(value).__name__}")
        _check_dataclass(value, path, depth)
    else:  # an annotation this walker does not know: refuse to guess
        raise TypeError(f"cannot validate {path} against {hint!r}")


def _check_dataclass(value: Any, path: str, depth: int) -> None:
    cls = type(value)
    for name, hint in _hints(cls).items():
        field_value = getattr(value, name)
        _check(field_value, hint, f"{path}.{name}", depth + 1)
        if hint is float and not isinstance(field_value, float):  # 2 means 2.0: libraries downstream insist
            object.__setattr__(value, name, float(field_value))
    for name, rule in _RULES.get(cls, {}).items():
        rule(getattr(value, name), f"{path}.{name}")
    own = getattr(value, "validate", None)
    if callable(own):  # a type's own consistency checks (LossConfig)
        try:
            own()
        except TinkerlessError as exc:
            raise InvalidRequest(f"{path}: {exc.message}", hint=exc.hint) from None


# ---- ranges ---------------------------------------------------------------------------------


def policy_name(value: Any, path: str) -> None:
    if value is not None:
        check_name(value, POLICY_NAME, where=path)


def _run_id(value: Any, path: str) -> None:
    check_name(value, RUN_ID, where=path)


def _checkpoint_file_prefix(value: Any, path: str) -> None:
    check_file_key(value, where=path, allow_empty=True, trailing_slash=True)


def _saved_policies(value: Any, path: str) -> None:
    _non_empty(value, path)
    _checkpoint_policies(value, path)


def _checkpoint_policies(value: Any, path: str) -> None:
    """No two policies with the same name or file prefix: such a save could not be restored (which policy's
    files are under the prefix?), nor such a restore tell its policies apart."""
    seen: dict[str, dict[Any, Any]] = {"name": {}, "file_prefix": {}}
    for i, policy in enumerate(value):
        for field, names in seen.items():
            key = getattr(policy, field, None)
            if isinstance(key, str) and key in names:
                _fail(f"{path}[{i}].{field}", f"{key[:64]!r} is also policy {names[key]}'s: a checkpoint's policies "
                      "need names and file prefixes of their own (e.g. 'policies/NAME/')")
            if isinstance(key, str):
                names[key] = i


def _file_keys(value: Any, path: str) -> None:
    """Names of checkpoint files (map keys or a list): relative keys of plain file names, nothing path-shaped."""
    for key in value:
        check_file_key(key, where=f"{path} key")


def _temperature(value: Any, path: str) -> None:
    # 0, and anything under GREEDY_BELOW, samples greedily (the rule of every API and engine); NaN is refused.
    from tinkerless.wire.messages import GREEDY_BELOW

    if not 0 <= value <= 100:
        _fail(path, f"is {value!r}; use a value in [0, 100] (0, or anything under {GREEDY_BELOW}: greedy)")


def trainable_policy(value: Any, path: str) -> None:
    policy_name(value, path)
    if value == "base":
        _fail(path, "is the base model, which is shared and never trained", "name one of your own policies")


def _json(value: Any, path: str) -> None:
    _check_plain(value, path, 0)


def _json_object(value: Any, path: str) -> None:
    check_json_object(value, path)


def _agent_transport(value: Any, path: str) -> None:
    if value not in ("asgi", "http"):
        _fail(path, f"is {str(value)[:40]!r}, not 'asgi' or 'http'")


def _rules() -> dict[type, dict[str, Callable[[Any, str], None]]]:
    from tinkerless.wire import messages as m
    from tinkerless.wire import runs as r

    # Annotated Any on the wire, which sits below the functions and does not import them: the loss config is
    # known by its wire tag (its own `validate()` then checks its values).
    loss = _tagged("tinkerless.functions.losses", "LossConfig")

    seed = between(0, MAX_SEED)
    count = between(1, MAX_COUNT)
    step = between(0, MAX_STEP)
    return {
        m.SamplingParams: {"max_tokens": between(0, MAX_TOKENS), "temperature": _temperature, "top_p": between(0, 1, low_open=True),
                           "top_k": between(0, MAX_TOKENS)},
        m.LoraConfig: {"rank": between(1, 256), "alpha": between(0, low_open=True), "dropout": between(0, 1, high_open=True),
                       "target_modules": _non_empty, "seed": seed, "vision": _one_of("none", "connector", "tower")},
        m.AdamParams: {"learning_rate": between(0, MAX_LEARNING_RATE), "beta1": between(0, 1, high_open=True),
                       "beta2": between(0, 1, high_open=True), "eps": between(0, low_open=True),
                       "weight_decay": between(0), "grad_clip_norm": between(0)},
        m.EpisodeLimits: {"max_turns": count, "max_episode_tokens": between(1, MAX_TOKENS)},
        m.CreatePolicyRequest: {"policy": trainable_policy},
        m.ResetPolicyRequest: {"policy": trainable_policy},
        m.DeletePolicyRequest: {"policy": trainable_policy},
        m.RolloutRequest: {"policy": policy_name, "group_size": count, "seed": seed, "tasks": _json,
                           "agent_timeout": between(0, 86400, low_open=True), "agent_transport": _agent_transport},
        m.MultiAgentRolloutRequest: {"group_size": count, "seed": seed, "tasks": _json,
                                     "protocol_timeout": between(0, 86400, low_open=True), "seats": _non_empty},
        m.Seat: {"policy": policy_name},
        m.JudgeSpec: {"rubric": _bounded_text(20_000), "mode": _one_of("pointwise", "group"), "model": _bounded_text(500),
                      "endpoint": _endpoint_url, "weight": between(-1e6, 1e6), "timeout": between(0, 3600, low_open=True),
                      "retries": between(0, 5), "max_tokens": between(1, 256)},
        m.ForwardRequest: {"policy": policy_name, "topk": between(0, MAX_TOPK)},
        m.ForwardBackwardRequest: {"policy": trainable_policy, "data": _non_empty, "loss": loss},
        m.OptimStepRequest: {"policy": trainable_policy},
        m.UpdateRequest: {"policy": trainable_policy, "data": _non_empty, "loss": loss,
                          "max_staleness": between(0, MAX_STEP)},
        m.SampleRequest: {"policy": policy_name, "prompts": _non_empty, "num_samples": count, "seed": seed},
        m.SaveStateRequest: {"policy": policy_name},
        m.PolicyState: {"policy": trainable_policy, "policy_version": step, "files": _file_keys},
        r.CheckpointPolicy: {"name": policy_name, "file_prefix": _checkpoint_file_prefix,
                             "worker_policy": policy_name, "version": step},
        r.SaveCheckpointRequest: {"run_id": _run_id, "step": step, "keep_last": count, "metadata": _json_object,
                                  "files": _file_keys, "policies": _saved_policies},
        r.RestoreCheckpointRequest: {"run_id": _run_id, "step": step, "keep_last": count,
                                     "client_files": _file_keys, "policies": _checkpoint_policies},
        r.RunCall: {"run_id": _run_id},
    }


_RULES: dict[type, dict[str, Callable[[Any, str], None]]] = {}


# ---- token ids ----------------------------------------------------------------------------


def _token_ids(request: Any, vocab_size: int) -> None:
    """Token ids must index the model's embedding: anything else fails deep inside the model."""
    from tinkerless.wire import messages as m

    def check(ids: Any, path: str) -> None:
        array = np.asarray(ids)
        if array.size and (array.min() < 0 or array.max() >= vocab_size):
            bad = int(array.min()) if array.min() < 0 else int(array.max())
            _fail(path, f"holds token id {bad}, outside this model's vocabulary [0, {vocab_size})",
                  "tokenize with the server model's own tokenizer")

    for name in ("data",):
        for i, datum in enumerate(getattr(request, name, None) or []):
            if isinstance(datum, m.Datum):
                check(datum.tokens, f"{type(request).__name__}.data[{i}].tokens")
                if datum.target_topk_ids is not None:
                    check(datum.target_topk_ids, f"{type(request).__name__}.data[{i}].target_topk_ids")
    if isinstance(request, m.SampleRequest):
        for i, prompt in enumerate(request.prompts):
            if isinstance(prompt, list):
                check(prompt, f"SampleRequest.prompts[{i}]")
    sampling = getattr(request, "sampling", None)
    if isinstance(sampling, m.SamplingParams):
        if sampling.stop_token_ids:
            check(sampling.stop_token_ids, f"{type(request).__name__}.sampling.stop_token_ids")
        if sampling.top_k > vocab_size:
            _fail(f"{type(request).__name__}.sampling.top_k", f"is {sampling.top_k}, above the vocabulary size {vocab_size}")


def _datums(request: Any) -> None:
    """Every per-token array of a Datum is 1-D, aligned with its tokens, and finite."""
    from tinkerless.wire import messages as m

    for i, datum in enumerate(getattr(request, "data", None) or []):
        if not isinstance(datum, m.Datum):
            continue
        path = f"{type(request).__name__}.data[{i}]"
        if datum.tokens.ndim != 1 or datum.tokens.dtype.kind not in "iu" or len(datum.tokens) < 1:
            _fail(f"{path}.tokens", "must be a non-empty 1-D integer array")
        versions = getattr(datum, "sampled_versions", None)
        if versions is not None and (versions.shape != datum.tokens.shape or versions.dtype.kind not in "iu"
                                     or (len(versions) and int(versions.min()) < -1)):
            _fail(f"{path}.sampled_versions", f"must be an integer array of shape {datum.tokens.shape}, -1 or more")
        for name in ("mask", "advantages", "sampler_logprobs", "old_logprobs", "ref_logprobs"):
            values = getattr(datum, name)
            if values is None:
                continue
            if values.shape != datum.tokens.shape or values.dtype.kind not in "fiu":
                _fail(f"{path}.{name}", f"must be a numeric array of shape {datum.tokens.shape}, got {values.shape}")
            if values.dtype.kind == "f" and not np.isfinite(values).all():
                _fail(f"{path}.{name}", "holds NaN or infinite values")
        _topk_targets(datum, path)


MAX_TOPK = 1024  # a teacher's top-k per position (the Tinker API's topk_prompt_logprobs allows as many)


def _topk_targets(datum: Any, path: str) -> None:
    """A teacher's top-k targets: both or neither, [N, k] with 1 <= k <= MAX_TOPK, log-probs finite and <= 0."""
    ids, logprobs = datum.target_topk_ids, datum.target_topk_logprobs
    if ids is None and logprobs is None:
        return
    if ids is None or logprobs is None:
        _fail(f"{path}.target_topk_ids", "and target_topk_logprobs come together")
    n = len(datum.tokens)
    if ids.ndim != 2 or ids.shape[0] != n or not 1 <= ids.shape[1] <= MAX_TOPK or ids.dtype.kind not in "iu":
        _fail(f"{path}.target_topk_ids", f"must be an integer array of shape [{n}, k] with 1 <= k <= {MAX_TOPK}")
    if logprobs.shape != ids.shape or logprobs.dtype.kind != "f":
        _fail(f"{path}.target_topk_logprobs", f"must be a float array of shape {ids.shape}")
    if not np.isfinite(logprobs).all() or (logprobs > 1e-4).any():
        _fail(f"{path}.target_topk_logprobs", "must hold finite log-probs (<= 0)")


def validate(request: Any, *, vocab_size: int | None = None) -> Any:
    """Check a decoded request (any tinkerless wire dataclass); InvalidRequest names the first bad field."""
    if not _RULES:
        _RULES.update(_rules())
    if not (dataclasses.is_dataclass(request) and not isinstance(request, type)):
        _fail("the request", f"must be a tinkerless request type, got {type(request).__name__}")
    _check_dataclass(request, type(request).__name__, 0)
    _datums(request)
    check_single_turn_tasks(request)
    check_request_images(request)
    if vocab_size is not None:
        _token_ids(request, vocab_size)
    return request

