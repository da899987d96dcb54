"""Hostile requests for every route of `tinkerless serve`, as hypothesis strategies (tests/test_fuzz.py, bench/fuzz.py).

A `Target` is a live server with two tenants, a policy, a coordinator run (with its lease), a
Tinker session and a Tinker training model already made, so that mutated requests get past
the first lookups and reach the code behind them. `requests(target)` draws one hostile request:

- msgpack routes (`/v1/call/*`, `/v1/runs/*`): a valid request of the route's type with one
  field, anywhere in it, replaced by a hostile value; or a raw envelope (no body, another
  version, a made-up type tag, a foreign class, nesting past msgpack's own limit); or bytes;
- Tinker JSON routes: a valid body with one field replaced, or a body that is not an object
  ([], null, a number), nested 100,000 levels, 1e999, NaN, not UTF-8, or empty;
- headers: sequence numbers that are not numbers, zero, huge or reused; bad or missing keys.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import msgpack
import numpy as np
from hypothesis import strategies as st

from tinkerless.functions.losses import LossConfig
from tinkerless.wire import PYTHON_VERSION, encode, encode_message
from tinkerless.wire.code import CodeBlob
from tinkerless.wire.http import MSGPACK, SEQ_HEADER, STREAM_HEADER
from tinkerless.wire.messages import (
    AdamParams, CreatePolicyRequest, Datum, EpisodeLimits, ForwardBackwardRequest, ForwardRequest, LoadStateRequest,
    JudgeSpec, LoraConfig, MultiAgentRolloutRequest, OptimStepRequest, PolicyState, ResetPolicyRequest, RolloutRequest,
    SampleRequest, SamplingParams, SaveStateRequest, Seat, UpdateRequest,
)
from tinkerless.wire.runs import (
    CheckpointPolicy, RestoreCheckpointRequest, RunCall, RunListRequest, SaveCheckpointRequest,
)

POLICY = "fz"


@dataclass
class Target:
    url: str
    keys: dict[str, str]  # tenant -> API key
    run_id: str = "fuzzrun"
    lease: str = ""
    session_id: str = ""
    model_id: str = ""
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=120))

    def auth(self, tenant: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def _datum() -> Datum:
    tokens = np.array([5, 6, 7, 8], dtype=np.int32)
    ones = np.ones(4, dtype=np.float32)
    return Datum(tokens, np.array([0, 1, 1, 1], np.float32), advantages=ones, sampler_logprobs=-ones)


def call_templates() -> dict[str, Any]:
    """A valid request for each worker function (on the tenant's policy `fz`)."""
    sampling = SamplingParams(max_tokens=2)
    return {
        "info": {},
        "create_policy": CreatePolicyRequest(POLICY, LoraConfig(rank=2)),
        "reset_policy": ResetPolicyRequest(POLICY),
        "rollout": RolloutRequest(POLICY, [{"prompt": "hi"}], 1, sampling, EpisodeLimits(), 0,
                                  judge=JudgeSpec("The reply greets the user.")),
        "rollout_multi": MultiAgentRolloutRequest(
            [{}], 1, CodeBlob("env", PYTHON_VERSION, b"not a pickle"), {"a": Seat(POLICY)}, sampling, EpisodeLimits(), 0
        ),
        "sample": SampleRequest(POLICY, [[1, 2, 3]], 1, sampling),
        "forward": ForwardRequest(POLICY, [_datum()]),
        "forward_backward": ForwardBackwardRequest(POLICY, [_datum()], LossConfig()),
        "optim_step": OptimStepRequest(POLICY, AdamParams()),
        "update": UpdateRequest(POLICY, [_datum()], LossConfig(), AdamParams()),
        "save_state": SaveStateRequest(POLICY),
        "load_state": LoadStateRequest(PolicyState(POLICY, {"adapter/adapter_config.json": b"{}"})),
    }


def run_templates(target: Target) -> dict[str, tuple[str, Any]]:
    """path -> a valid run request of the fuzzed run (with its lease)."""
    policies = [CheckpointPolicy("default", "", POLICY)]
    calls = {
        "create": {"config": {}}, "open": {}, "state": {}, "begin_rollout": {"step": 0, "participants": ["default"]},
        "submit_rollout": {"step": 0, "participant": "default"}, "wait_rollouts": {"step": 0, "timeout": 0.1},
        "begin_update": {"step": 0}, "commit_update": {"step": 0, "metrics": {}}, "record_checkpoint": {"step": 0},
        "reset_to_checkpoint": {"step": 0, "config": None}, "finish": {"status": "failed", "summary": {}},
    }
    out = {f"/v1/runs/call/{m}": RunCall(target.run_id, args, target.lease) for m, args in calls.items()}
    out["/v1/runs/list"] = RunListRequest(None)
    out["/v1/runs/checkpoint/save"] = SaveCheckpointRequest(
        target.run_id, target.lease, 0, policies, {"client.json": b"{}"}, {}, 2
    )
    out["/v1/runs/checkpoint/restore"] = RestoreCheckpointRequest(target.run_id, target.lease, policies, ["client.json"])
    return out


def tinker_templates(target: Target) -> dict[str, dict]:
    s, m = target.session_id, target.model_id
    return {
        "create_session": {"tags": [], "user_metadata": None},
        "session_heartbeat": {"session_id": s},
        "telemetry": {"events": []},
        "create_model": {"session_id": s, "model_seq_id": 99, "lora_config": {"rank": 2, "seed": 1},
                         "optimizer_config": {"type": "adamw"}},
        "get_info": {"model_id": m},
        "optim_step": {"model_id": m, "adam_params": {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
                       "seq_id": 10**6},
        "save_weights": {"model_id": m, "path": "w1", "seq_id": 10**6 + 1},
        "save_weights_for_sampler": {"model_id": m, "path": "s1", "seq_id": 10**6 + 2},
        "load_weights": {"model_id": m, "path": f"tinker://{m}/weights/none", "optimizer": False},
        "create_sampling_session": {"session_id": s, "sampling_session_seq_id": 1, "base_model": None,
                                    "model_path": None},
        "asample": {"base_model": None, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "num_samples": 1, "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 1}},
        "retrieve_future": {"request_id": "req-1"},
        "client/config": {},
    }


# ---- hostile values ----------------------------------------------------------------------

_NUMBERS = [-(2**63), -1, 0, 1, 2**31, 2**63 - 1, 2**64 - 1, float("nan"), float("inf"), -float("inf"), 1e308, -0.0,
            5.0, 1.5, 1e-320]
_STRINGS = ["", "base", "x\n", "../../etc/passwd", "/abs/path", "a" * 300, "é", "lora_", "a/b", "\x00", "t1234_x",
            "tinker://x/weights/../../y"]


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


hostile_values = st.one_of(
    st.sampled_from(_NUMBERS),
    st.sampled_from(_STRINGS),
    st.sampled_from([None, True, False, b"\xff" * 8, [], {}, [None], {"a": None}, _deep(40), _deep(700)]),
    st.integers(min_value=-5, max_value=70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.none()), max_size=4),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(-9, 9), st.none(), st.text(max_size=4)), max_size=3),
    st.sampled_from([SamplingParams(), LoraConfig(), AdamParams(), CheckpointPolicy("a", "", "b")]),
    st.sampled_from([np.array([1.0, float("nan")]), np.zeros((2, 2), np.int64), np.array([10**9], np.int64),
                     np.array([], np.float32), np.array([-1, 3], np.int32)]),
)

hostile_json = st.one_of(
    st.sampled_from([n for n in _NUMBERS if n == n and abs(n) != float("inf")]),
    st.sampled_from(_STRINGS),
    st.sampled_from([None, True, [], {}, [None], {"a": None}, _deep(40)]),
    st.integers(min_value=-5, max_value=70),
    st.text(max_size=40),
    st.lists(st.integers(-(2**70), 2**70), max_size=4),
    st.dictionaries(st.text(max_size=6), st.one_of(st.integers(-9, 9), st.none(), st.text(max_size=4)), max_size=3),
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every field, map entry and list element inside `value`, as access paths."""
    out: list[tuple] = []
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return out
    for key, child in items:
        out.append(prefix + (key,))
        out.extend(_paths(child, prefix + (key,)))
    return out


def _replace(value: Any, path: tuple, new: Any) -> Any:
    value = copy.deepcopy(value)
    parent = value
    for key in path[:-1]:
        parent = getattr(parent, key) if dataclasses.is_dataclass(parent) else parent[key]
    if dataclasses.is_dataclass(parent):
        object.__setattr__(parent, path[-1], new)  # frozen wire types too (LossConfig)
    else:
        parent[path[-1]] = new
    return value


@st.composite
def mutated(draw, template: Any, values=hostile_values) -> Any:
    paths = _paths(template)
    if not paths or draw(st.integers(0, 9)) == 0:
        return draw(values)  # the whole body replaced
    return _replace(template, draw(st.sampled_from(paths)), draw(values))


# ---- raw bodies -------------------------------------------------------------------------

def _raw_envelope(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


RAW_MSGPACK = [
    b"",
    b"\x00TLW",
    b"\x00TLW" + b"\xff" * 8,
    _raw_envelope({"v": 1, "py": PYTHON_VERSION}),  # an envelope without its body
    _raw_envelope({"v": 2, "py": PYTHON_VERSION, "body": {}}),
    _raw_envelope({"v": [1], "body": None}),
    _raw_envelope({"v": 1, "body": {"__dc__": "os:system", "command": "true"}}),
    _raw_envelope({"v": 1, "body": {"__dc__": "tinkerless.errors:UserError"}}),
    _raw_envelope({"v": 1, "body": {"__dc__": "tinkerless.wire.messages:Nope"}}),
    _raw_envelope({"v": 1, "body": {"__dc__": 5}}),
    _raw_envelope({"v": 1, "body": {"__dc__": "tinkerless.wire.messages:SampleRequest"}}),  # fields missing
    _raw_envelope({"v": 1, "body": {"__dc__": "tinkerless.wire.messages:SampleRequest", "policy": POLICY,
                                    "prompts": [[1]], "sampling": {"max_tokens": "2"}}}),
    _raw_envelope([1, 2, 3]),
    _raw_envelope(None),
    b"\x81\xa1v\x01" + b"\x91" * 300 + b"\xc0",
    _raw_envelope({"v": 1, "py": PYTHON_VERSION, "body": _deep(900)}),
    b"\x91" * 1100 + b"\xc0",
    b"\x91" * 100_000 + b"\xc0",
    b"\xc1",
    b"\xd4\x01\x00",  # an unknown extension
    encode({"v": 1, "py": PYTHON_VERSION, "body": np.zeros(3)})[:-5],  # a truncated frame
]

RAW_JSON = [b"", b"[]", b"null", b"5", b'"x"', b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000,
            b'{"model_id": 1e999}', b'{"seq_id": 1e999, "model_id": "x"}', b'{"x": NaN}', b"\xff\xfe", b"{",
            b'{"request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"]


@dataclass
class HttpRequest:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    tenant: str | None = "alice"  # whose key it carries; None: a bad key

    def send(self, target: Target) -> httpx.Response:
        headers = dict(self.headers)
        if self.tenant is None:
            headers["Authorization"] = "Bearer tml-nope-nope"
        else:
            headers.update(target.auth(self.tenant))
        return target.http.request(self.method, target.url + self.path, content=self.body, headers=headers)


_seq_values = st.one_of(
    st.sampled_from(["0", "-1", "abc", "1.5", "99999999999999999999999", "", "1e3", "1", "+1", "0x1"]),
    st.integers(1, 3).map(str),
    st.text(max_size=8),
)


def _headers(draw, ordered: bool) -> dict[str, str]:
    headers = {"Content-Type": MSGPACK}
    if ordered or draw(st.booleans()):
        stream = draw(st.sampled_from(["fuzz-stream", "", "s" * 200, "other"]))
        seq = draw(_seq_values)
        # Header values a client can send at all (HTTP trims surrounding blanks and forbids control characters).
        if all(c.isprintable() and ord(c) < 128 for c in seq + stream) and seq == seq.strip():
            headers.update({STREAM_HEADER: stream, SEQ_HEADER: seq})
    return headers


@st.composite
def requests(draw, target: Target) -> HttpRequest:
    """One hostile request to any route of any API."""
    tenant = draw(st.sampled_from(["alice", "alice", "alice", "bob", None]))
    kind = draw(st.sampled_from(["call", "call", "runs", "runs", "tinker", "tinker", "raw", "get"]))
    if kind == "call":
        templates = call_templates()
        method = draw(st.sampled_from([*templates, "nope", "__init__", "handle", "drop_policy"]))
        body = draw(mutated(templates.get(method, {})))
        return HttpRequest("POST", f"/v1/call/{method}", _encode(body), _headers(draw, False), tenant)
    if kind == "runs":
        templates = run_templates(target)
        path = draw(st.sampled_from([*templates, "/v1/runs/call/nope", "/v1/runs/call/__init__"]))
        body = draw(mutated(templates.get(path, RunCall(target.run_id))))
        return HttpRequest("POST", path, _encode(body), _headers(draw, path.startswith("/v1/runs/checkpoint")), tenant)
    if kind == "tinker":
        templates = tinker_templates(target)
        name = draw(st.sampled_from([*templates, "forward_backward", "sessions/x/finish"]))
        if name == "forward_backward":  # protobuf: garbage bytes
            body = draw(st.binary(max_size=200))
        elif draw(st.integers(0, 4)) == 0:
            body = draw(st.sampled_from(RAW_JSON))
        else:
            body = json.dumps(draw(mutated(templates.get(name, {}), hostile_json))).encode()
        return HttpRequest("POST", f"/api/v1/{name}", body, {"Content-Type": "application/json"}, tenant)
    if kind == "raw":
        path = draw(st.sampled_from([f"/v1/call/{m}" for m in [*call_templates(), "nope"]] + list(run_templates(target))))
        body = draw(st.one_of(st.sampled_from(RAW_MSGPACK), st.binary(max_size=64)))
        return HttpRequest("POST", path, body, _headers(draw, False), tenant)
    run = draw(st.sampled_from([target.run_id, "nope", "x%0A", "..", "%2e%2e", "a" * 300]))
    path = draw(st.sampled_from([
        "/healthz", "/metrics", "/api/v1/healthz", "/api/v1/get_server_capabilities", "/api/v1/training_runs",
        "/api/v1/training_runs?limit=abc", "/api/v1/training_runs?limit=-5&offset=1e999",
        f"/api/v1/training_runs/{run}", f"/api/v1/training_runs/{run}/checkpoints", "/api/v1/samplers/nope",
        f"/api/v1/samplers/{target.session_id}:sample:1",
    ]))
    method = "DELETE" if draw(st.integers(0, 5)) == 0 else "GET"
    if method == "DELETE":
        path = f"/api/v1/training_runs/{run}/checkpoints/{draw(st.sampled_from(['weights', 'x', '..']))}/w1"
    return HttpRequest(method, path, b"", {}, tenant)


def _encode(body: Any) -> bytes:
    try:
        return encode_message(body)
    except Exception:  # a value the codec cannot send (an int past 64 bits): send it as plain msgpack instead
        return _raw_envelope({"v": 1, "py": PYTHON_VERSION, "body": repr(body)[:200]})


@contextlib.contextmanager
def fuzzed_server(model: str, storage) -> Iterator[Target]:
    """`tinkerless serve`'s app on 127.0.0.1 with auth on, tenants alice and bob, storage in `storage`, and the
    fuzzed tenant's policy, run, Tinker session and model already made (`prepare`)."""
    from tinkerless.functions.worker import Worker
    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore

    keys = KeyStore(ObjectStore(str(storage)))
    tenants = {name: keys.create(name) for name in ("alice", "bob")}
    with serve_in_thread(create_app(Worker(model), keys=keys, storage=str(storage))) as url:
        target = prepare(Target(url, tenants))
        try:
            yield target
        finally:
            target.http.close()


def prepare(target: Target) -> Target:
    """Give the fuzzed tenant a policy, a run with its lease, a Tinker session and training model."""
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.sdk.backends.server_runs import ServerRunHost
    from tinkerless.sdk.backends.base import call

    backend = HTTPBackend(target.url, api_key=target.keys["alice"])
    call(backend, "create_policy", CreatePolicyRequest(POLICY, LoraConfig(rank=2)))
    coordinator = ServerRunHost(backend).create(target.run_id, {"name": "fuzz"})
    target.lease = coordinator.lease or ""
    session = target.http.post(f"{target.url}/api/v1/create_session", json={}, headers=target.auth()).json()
    target.session_id = session["session_id"]
    created = target.http.post(f"{target.url}/api/v1/create_model", headers=target.auth(),
                               json={"session_id": target.session_id, "model_seq_id": 0, "lora_config": {"rank": 2}})
    request_id = created.json()["request_id"]
    result = target.http.post(f"{target.url}/api/v1/retrieve_future", headers=target.auth(),
                              json={"request_id": request_id}).json()
    target.model_id = result["model_id"]
    return target


def still_serves(target: Target) -> None:
    """A normal call after the fuzzing: the server is up and its model answers."""
    from tinkerless.sdk.backends.base import call
    from tinkerless.sdk.backends.http import HTTPBackend

    backend = HTTPBackend(target.url, api_key=target.keys["bob"])
    result = call(backend, "sample", SampleRequest("base", [[1, 2, 3]], 2, SamplingParams(max_tokens=3)))
    assert len(result.sequences[0]) == 2
    assert httpx.get(f"{target.url}/healthz", headers=target.auth()).json()["status"] == "ok"
