"""Schema-driven fuzzing of every msgpack route of `tinkerless serve`: every field of every wire message.

For each route's request type a valid template is mutated at one field, map entry or list element, with a
value drawn from that field's annotation (`schema_fuzz.hostile_for`): None, the wrong type, NaN and +-inf,
integers at and beyond 2**63, empty, huge, control-character, path-shaped and look-alike strings, nested
lists of the wrong shape. The property: never a 5xx, and every 4xx is an `ErrorReply` of category "user".
The first test sends None (and a string, and 2**63) to every field of every route, exhaustively; the
second draws the rest with hypothesis. A field added to a wire message later is covered without a case.
"""

from __future__ import annotations

import os

import pytest
from fuzz_cases import POLICY, Target, _encode, fuzzed_server, still_serves
from hypothesis import HealthCheck, given, settings, strategies as st
from schema_fuzz import field_paths, hostile_for, replaced, routes, wire_dataclasses

from tinkerless.wire import decode_message
from tinkerless.wire.http import MSGPACK
from tinkerless.wire.messages import ErrorReply

EXAMPLES = int(os.environ.get("TINKERLESS_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def target(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("schema-fuzz")
    with fuzzed_server(tiny_model, storage) as target:
        yield target, storage


def send(target: Target, path: str, body: object):
    response = target.http.post(target.url + path, content=_encode(body),
                                headers={**target.auth(), "Content-Type": MSGPACK})
    where = f"POST {path} with {str(body)[:300]}"
    if response.status_code >= 500:
        reply = decode_message(response.content)
        detail = f"{reply.error}\n{reply.traceback}" if isinstance(reply, ErrorReply) else response.content[:600]
        pytest.fail(f"{where} -> {response.status_code}: {detail}")
    if response.status_code >= 400 and response.status_code not in (401, 404, 409, 413, 429):
        reply = decode_message(response.content)
        assert isinstance(reply, ErrorReply) and reply.category == "user" and reply.error, (where, reply)
    return response


def test_every_route_has_a_template_of_its_request_type(target):
    """A route (or a wire request type) added later without a template here fails this test, not silently."""
    from tinkerless.functions.worker import _REQUEST_TYPES

    target, _ = target
    templates = routes(target)
    for method, request_type in _REQUEST_TYPES.items():
        assert isinstance(templates[f"/v1/call/{method}"], request_type), method
    sent = {type(t) for t in templates.values()}
    nested = {type(v) for t in templates.values() for v in _dataclasses_in(t)}
    # Every wire dataclass a client can send is sent, at the top or nested (replies are never sent).
    replies = {"RolloutResult", "Episode", "TrainingSequence", "ForwardResult", "ForwardBackwardResult",
               "OptimStepResult", "UpdateResult", "SampledSequence", "SampleResult", "ErrorReply", "RunReply",
               "RunList", "RestoredCheckpoint"}
    missing = {c.__name__ for c in wire_dataclasses()} - {c.__name__ for c in sent | nested} - replies
    assert not missing, f"wire types no template sends: {sorted(missing)}"


def _dataclasses_in(value):
    import dataclasses

    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield value
        for f in dataclasses.fields(value):
            yield from _dataclasses_in(getattr(value, f.name))
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _dataclasses_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _dataclasses_in(v)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_none_a_string_and_2_63_in_every_field_of_every_route(target):
    target, _ = target
    for path, template in routes(target).items():
        for where, _hint in list(field_paths(template)):
            for value in (None, "../../server/api_keys.json", 2**63, [[None]]):
                send(target, path, replaced(template, where, value))
    still_serves(target)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_values_drawn_from_each_fields_type_never_get_a_5xx(target):
    target, storage = target
    templates = routes(target)
    cases = [(path, where, hint) for path, template in templates.items() for where, hint in field_paths(template)]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        path, where, hint = data.draw(st.sampled_from(cases))
        send(target, path, replaced(templates[path], where, data.draw(hostile_for(hint))))

    one()
    still_serves(target)
    names = [str(p.relative_to(storage)) for p in storage.rglob("*")]
    assert not [n for n in names if ".." in n.split("/") or any(not c.isprintable() for c in n)], names
    assert all(len(part.encode()) <= 255 for n in names for part in n.split("/"))



def test_the_issues_classes_are_400s_of_category_user(target):
    """The classes the outside fuzzer found, each at the boundary (the draws above cover them among others)."""
    from tinkerless.wire.messages import EpisodeLimits, RolloutRequest, SamplingParams
    from tinkerless.wire.runs import CheckpointPolicy, RestoreCheckpointRequest, RunCall, SaveCheckpointRequest

    target, storage = target

    def refused(path: str, body: object) -> str:
        response = send(target, path, body)
        assert response.status_code == 400, (path, body, response.status_code)
        return decode_message(response.content).error

    import numpy as np

    for config in ({"nope": 1}, {"": None, "a/b": [1, {"x": None}]}, {"learning_rate": "fast"}, {1: "int key", "b": 2},
                   {"b": b"\xff"}, {"arr": np.zeros(2)}, {"n": float("nan")}, {"deep": [[[[{"x": 2**64 - 1}]]]]}):
        response = send(target, "/v1/runs/call/create", RunCall(f"cfg-{len(str(config))}", {"config": config}))
        assert response.status_code in (200, 400), response.status_code
    for messages in (["hi"], [None], [{"role": 5, "content": "x"}], [{"content": "x"}], "hi", [{"role": "user"}]):
        request = RolloutRequest(POLICY, [{"messages": messages}], 1, SamplingParams(max_tokens=2), EpisodeLimits(), 0)
        assert "messages" in refused("/v1/call/rollout", request)
    bad_names = ["", "x\n", "../x", "../../server/api_keys.json", "..", "a" * 256, "\x00", "a\u2215b/", "é/",
                 "/abs/", "policies/../", "\u2024\u2024/"]
    for prefix in bad_names:
        policies = [CheckpointPolicy("default", prefix, POLICY)]
        save = SaveCheckpointRequest(target.run_id, target.lease, 1, policies, {})
        restore = RestoreCheckpointRequest(target.run_id, target.lease, policies, [])
        if prefix:  # "" is the top-level layout: valid
            assert "file_prefix" in refused("/v1/runs/checkpoint/save", save)
            assert "file_prefix" in refused("/v1/runs/checkpoint/restore", restore)
    for step in (2**63 - 1, 2**64 - 1, -1):
        policies = [CheckpointPolicy("default", "", POLICY)]
        assert "step" in refused("/v1/runs/checkpoint/save", SaveCheckpointRequest(target.run_id, target.lease, step,
                                                                                     policies, {}))
        assert "step" in refused("/v1/runs/checkpoint/restore", RestoreCheckpointRequest(
            target.run_id, target.lease, policies, [], step=step))
    for key in ("../x.json", "a/../../b", "/etc/x", "x\n.json", "."):
        policies = [CheckpointPolicy("default", "", POLICY)]
        refused("/v1/runs/checkpoint/save", SaveCheckpointRequest(target.run_id, target.lease, 1, policies, {key: b"x"}))
        refused("/v1/runs/checkpoint/restore", RestoreCheckpointRequest(target.run_id, target.lease, policies, [key]))
    for metadata in ({1: "x", "a": 2}, {"a": {0: 1}}, {"b": b"\xff"}, {"n": [1, {"x": np.zeros(2)}]}):
        policies = [CheckpointPolicy("default", "", POLICY)]
        assert "metadata" in refused("/v1/runs/checkpoint/save", SaveCheckpointRequest(
            target.run_id, target.lease, 1, policies, {}, metadata))
    names = [str(p.relative_to(storage)) for p in storage.rglob("*")]
    assert not [n for n in names if "api_keys" in n and not n.startswith("server/")], names
