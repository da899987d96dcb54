"""Property-based fuzzing of every route of every API of `tinkerless serve` (auth on, two tenants).

For hostile bodies and headers on the msgpack functions (/v1/call/*), the hosted runs
(/v1/runs/*), the Tinker API (/api/v1/*), /healthz and /metrics: no answer is a 5xx, every
4xx says what went wrong with category "user", the server still serves a normal call
afterwards, and nothing is written outside the calling tenant's prefix in its storage.
`bench/fuzz.py` runs the same cases at a larger count and prints the status-code table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fuzz_cases import fuzzed_server, requests, still_serves
from hypothesis import HealthCheck, given, settings

from tinkerless.wire import decode_message
from tinkerless.wire.messages import ErrorReply

EXAMPLES = int(os.environ.get("TINKERLESS_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def target(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("fuzz-storage")
    with fuzzed_server(tiny_model, storage) as target:
        yield target, storage, _files(storage)
        target.http.close()


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def assert_typed_answer(response, request) -> None:
    where = f"{request.method} {request.path} (tenant {request.tenant}, body {request.body[:120]!r})"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.content[:500]!r}"
    if response.status_code < 400 or response.status_code in (401, 404, 405, 408, 429):
        return
    if response.headers.get("content-type", "").startswith("application/msgpack"):
        reply = decode_message(response.content)
        assert isinstance(reply, ErrorReply) and reply.category == "user" and reply.error, where
    elif response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        if isinstance(body, dict) and "category" in body:  # FastAPI's own 422s carry "detail" instead
            assert body["category"] == "user" and body["error"], where


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_no_hostile_request_gets_a_5xx_or_leaves_its_tenant(target):
    target, storage, before = target

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=requests(target))
    def one(data):
        assert_typed_answer(data.send(target), data)

    one()
    still_serves(target)

    # Whatever was written went under the tenant's own prefix: the fuzzed tenants' names only (and the server's own
    # record of what each key spent, server/budgets.py, which no request names).
    from tinkerless.server.budgets import USAGE_FILE

    new = _files(storage) - before - {USAGE_FILE}
    outside = sorted(f for f in new if not (f.startswith("tenants/alice/") or f.startswith("tenants/bob/")))
    assert not outside, f"files written outside the tenants' prefixes: {outside[:10]}"
    assert not [f for f in new if any(not c.isprintable() for c in f)], "a file name holds control characters"


def test_the_issues_malformed_inputs_are_typed_400s(target):
    """The cases the issue names, one by one (the fuzz draws them too, among many others)."""
    target, _, _ = target
    http, url, auth = target.http, target.url, target.auth()
    msgpack_headers = {**auth, "Content-Type": "application/msgpack"}

    def status(method: str, path: str, body: bytes = b"", headers=None) -> int:
        response = http.request(method, url + path, content=body, headers=headers or msgpack_headers)
        assert response.status_code < 500, (path, body[:80], response.content[:300])
        return response.status_code

    from fuzz_cases import RAW_MSGPACK, _raw_envelope

    from tinkerless.wire import encode_message
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, LoraConfig, OptimStepRequest
    from tinkerless.wire.runs import RunCall

    no_body = _raw_envelope({"v": 1, "py": "3.11"})
    assert status("POST", "/v1/call/sample", no_body) == 400
    assert status("POST", "/v1/runs/list", no_body) == 400
    for deep in RAW_MSGPACK[-7:-3]:
        assert status("POST", "/v1/call/forward", deep) == 400
        for path in ("/v1/call/info", "/v1/call/nope", "/v1/runs/list", "/v1/runs/call/open"):
            status("POST", path, deep)  # no 5xx, whatever the route does with the body
    for seq in ("abc", "0", "²"):
        assert status("POST", "/v1/call/info", encode_message({}), {**msgpack_headers, "X-Tinkerless-Stream": "s",
                                                                    "X-Tinkerless-Seq": seq.encode()}) == 400
    ordered = {**msgpack_headers, "X-Tinkerless-Stream": "repeat", "X-Tinkerless-Seq": "1"}
    assert status("POST", "/v1/call/info", encode_message({}), ordered) == 200
    assert status("POST", "/v1/call/info", encode_message({}), ordered) == 400  # the same number again
    json_headers = {**auth, "Content-Type": "application/json"}
    for body in (b"[]", b"null", b"5", b"[" * 100_000 + b"]" * 100_000, b'{"model_id": 1e999}'):
        assert status("POST", "/api/v1/optim_step", body, json_headers) == 400
    assert status("POST", "/api/v1/asample", json.dumps({"sampling_params": 5, "base_model": None}).encode(),
                  json_headers) == 400
    assert status("POST", "/api/v1/create_model", json.dumps({
        "session_id": target.session_id, "model_seq_id": 7, "lora_config": {"rank": 0}}).encode(), json_headers) == 400
    for body in (b"", b"not json", b"[]"):
        assert status("POST", "/api/v1/retrieve_future", body, json_headers) == 400
    for rank in (0, -1):
        assert status("POST", "/v1/call/create_policy", encode_message(CreatePolicyRequest("rk", LoraConfig(rank=rank)))) == 400
    assert status("POST", "/v1/call/create_policy", encode_message(CreatePolicyRequest("p" * 256))) == 400
    for adam in (AdamParams(beta1=5), AdamParams(learning_rate=-1), AdamParams(learning_rate=float("nan"))):
        assert status("POST", "/v1/call/optim_step", encode_message(OptimStepRequest("fz", adam))) == 400
    assert status("POST", "/v1/runs/call/begin_update", encode_message(RunCall(target.run_id, {"step": "x"}, target.lease))) == 400
    assert status("POST", "/v1/runs/call/create", encode_message(RunCall("newline\n"))) == 400
    nan_wait = RunCall(target.run_id, {"step": 0, "timeout": float("nan")}, target.lease)
    assert status("POST", "/v1/runs/call/wait_rollouts", encode_message(nan_wait)) == 400
