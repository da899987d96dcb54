"""`tinkerless serve` holding more than one base model: extra models (`--also-model`) answer forward and sample
exactly as a worker of their own does, behind the same keys, limits and scheduler as the main one; a call naming a
model the server does not hold, a method or a policy an extra model has not, is a 4xx of category "user" naming
what is served; each key's usage counts its calls on each extra model; /healthz, /v1/served-models and the OpenAI
/v1/models list them; the tokenizer route gives back the very tokenizer the server loaded."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tinkerless.errors import ConfigError
from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.http import MODEL_HEADER, MSGPACK
from tinkerless.wire.messages import (BASE_POLICY, CreatePolicyRequest, Datum, ErrorReply, ForwardRequest, LoraConfig,
                                      SampleRequest, SamplingParams)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model):
    """The main model (the session's tiny one) and an extra one of the same vocabulary but other weights."""
    teacher = build_tiny_model(tmp_path_factory.mktemp("served") / "teacher", hidden_size=64, num_layers=2, seed=1,
                               initializer_range=0.2)
    return tiny_model, teacher, Worker(teacher)


@pytest.fixture(scope="module")
def server(models, worker, tmp_path_factory):
    """A keyed server holding both (the extra model's worker shared with the tests' own reference calls)."""
    _, teacher, teacher_worker = models
    storage = tmp_path_factory.mktemp("server")
    keys = KeyStore(ObjectStore(str(storage)))
    alice, bob = keys.create("alice"), keys.create("bob")
    app = create_app(worker, keys=keys, storage=str(storage), price_per_hour=3600.0,
                     limits=ServingLimits(max_tokens=16), models={teacher: teacher_worker})
    with serve_in_thread(app) as url:
        yield url, alice, bob


def _call(url: str, key: str, method: str, request, model: str | bytes | None = None) -> tuple[int, object]:
    headers = {"Content-Type": MSGPACK, **({"Authorization": f"Bearer {key}"} if key else {})}
    if model is not None:
        headers[MODEL_HEADER] = model
    response = httpx.post(f"{url}/v1/call/{method}", content=encode_message(request), headers=headers, timeout=60)
    return response.status_code, decode_message(response.content)


def _data(seed: int, n: int = 3) -> list[Datum]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 12, size=n)
    return [Datum(tokens=rng.integers(3, 200, size=int(k)).astype(np.int32), mask=np.zeros(int(k), np.float32))
            for k in lengths]


def test_an_extra_model_answers_forward_and_sample_as_its_own_worker_does(models, server, worker):
    main, teacher, teacher_worker = models
    url, alice, _ = server
    data = _data(0)
    status, served = _call(url, alice, "forward", ForwardRequest(BASE_POLICY, data), model=teacher)
    assert status == 200, served
    direct = teacher_worker.forward(ForwardRequest(BASE_POLICY, data))
    on_main = worker.forward(ForwardRequest(BASE_POLICY, data))
    for a, b, c in zip(served.logprobs, direct.logprobs, on_main.logprobs):
        np.testing.assert_array_equal(a, b)  # the extra model's own numbers, bit for bit
        assert np.abs(a[1:] - c[1:]).max() > 1e-3  # not the main model's
    # The main model named by any of its names, or by no header, is the main worker.
    for name in (main, None):
        status, reply = _call(url, alice, "forward", ForwardRequest(BASE_POLICY, data), model=name)
        assert status == 200
        np.testing.assert_array_equal(reply.logprobs[0], on_main.logprobs[0])

    request = SampleRequest(BASE_POLICY, [[5, 6, 7], "hello"], 2, SamplingParams(max_tokens=6, temperature=1.0), seed=3)
    status, served = _call(url, alice, "sample", request, model=teacher)
    assert status == 200, served
    direct = teacher_worker.sample(request)
    assert [[s.tokens for s in p] for p in served.sequences] == [[s.tokens for s in p] for p in direct.sequences]


def test_unknown_models_methods_and_policies_are_user_errors_naming_what_is_served(models, server):
    main, teacher, _ = models
    url, alice, _ = server
    forward = ForwardRequest(BASE_POLICY, _data(1, 1))
    for name in ("nope", "", "a b", "x" * 5000, "../../etc/passwd", "smollm2\xe9".encode("latin-1"), "base", teacher + "/"):
        status, reply = _call(url, alice, "forward", forward, model=name)
        assert status == 400 and isinstance(reply, ErrorReply) and reply.category == "user", (name, reply)
        assert "does not hold model" in reply.error and repr(teacher) in reply.error, reply.error
        assert len(reply.error) < 1000  # a hostile name is cut, not echoed whole
    refused = [("create_policy", CreatePolicyRequest("mine", LoraConfig())), ("update", forward),
               ("rollout", forward), ("save_state", forward)]
    for method, request in refused:
        status, reply = _call(url, alice, method, request, model=teacher)
        assert status == 400 and reply.category == "user" and "answers info, forward, sample only" in reply.error
    for policy in ("default", "t0123456789ab_x"):  # an extra model holds no adapters
        status, reply = _call(url, alice, "forward", ForwardRequest(policy, _data(1, 1)), model=teacher)
        assert status == 400 and "holds no adapters" in reply.error
    # The serving limits hold on an extra model as on the main one.
    status, reply = _call(url, alice, "sample", SampleRequest(BASE_POLICY, [[5]], 1, SamplingParams(max_tokens=99)),
                          model=teacher)
    assert status == 400 and reply.category == "user" and "max_tokens" in reply.error
    # And no key, no call.
    response = httpx.post(f"{url}/v1/call/forward", content=encode_message(forward), headers={MODEL_HEADER: teacher})
    assert response.status_code == 401


def test_each_keys_usage_counts_its_calls_on_each_extra_model(models, server):
    _, teacher, _ = models
    url, alice, bob = server

    def usage(key):
        return httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()

    before_alice, before_bob = usage(alice), usage(bob)
    for seed in range(3):
        assert _call(url, alice, "forward", ForwardRequest(BASE_POLICY, _data(seed)), model=teacher)[0] == 200
    assert _call(url, alice, "forward", ForwardRequest(BASE_POLICY, _data(9)))[0] == 200  # the main model
    assert _call(url, bob, "forward", ForwardRequest(BASE_POLICY, _data(9)))[0] == 200
    # (A call's seconds are settled before its reply leaves: the usage read next already holds them.)
    after_alice, after_bob = usage(alice), usage(bob)
    line = after_alice["models"][teacher]
    before = before_alice["models"].get(teacher, {"calls": 0, "compute_seconds": 0.0})
    assert line["calls"] - before["calls"] == 3 and line["compute_seconds"] > before["compute_seconds"]
    assert after_alice["calls"] - before_alice["calls"] == 4  # all of them are the key's calls, charged in full
    assert after_alice["policy_seconds"] == pytest.approx(after_alice["compute_seconds"] - line["compute_seconds"])
    assert after_alice["spent_usd"] == pytest.approx(after_alice["compute_seconds"])  # $1 a second, the teacher's too
    assert teacher not in after_bob["models"] and after_bob["calls"] - before_bob["calls"] == 1


def test_the_server_lists_its_models_and_sends_their_tokenizers(models, server, worker):
    from transformers import AutoTokenizer

    main, teacher, teacher_worker = models
    url, alice, _ = server
    auth = {"Authorization": f"Bearer {alice}"}
    health = httpx.get(f"{url}/healthz", headers=auth).json()
    assert health["models"] == [main, teacher] and health["model"]
    listing = httpx.get(f"{url}/v1/served-models", headers=auth).json()
    assert [(m["id"], m["main"]) for m in listing["models"]] == [(main, True), (teacher, False)]
    assert listing["models"][1]["methods"] == ["info", "forward", "sample"]
    assert httpx.get(f"{url}/v1/served-models").status_code == 401
    openai = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=auth).json()["data"]]
    assert openai[:2] == [main, teacher]
    # Chat on an extra model says where it is served instead (a 400 in the OpenAI error shape).
    chat = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60,
                      json={"model": teacher, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 400 and "X-Tinkerless-Model" in chat.json()["error"]["message"] + str(chat.json())

    import tempfile
    from pathlib import Path

    for name, reference in ((teacher, teacher_worker), (main, worker)):
        reply = httpx.get(f"{url}/v1/served-models/tokenizer", params={"model": name}, headers=auth)
        assert reply.status_code == 200
        files = decode_message(reply.content)
        with tempfile.TemporaryDirectory() as tmp:
            for file, content in files["files"].items():
                (Path(tmp) / file).write_bytes(content)
            loaded = AutoTokenizer.from_pretrained(tmp)
        assert loaded.get_vocab() == reference.tokenizer.get_vocab()
        text = [{"role": "user", "content": "Héllo <tool_call>"}]
        assert loaded.apply_chat_template(text, tokenize=False) == reference.tokenizer.apply_chat_template(text, tokenize=False)
    missing = httpx.get(f"{url}/v1/served-models/tokenizer", params={"model": "nope"}, headers=auth)
    assert missing.status_code == 404 and repr(teacher) in decode_message(missing.content).error


def test_serve_refuses_a_model_named_twice_before_loading_any(tiny_model, tmp_path):
    from tinkerless.server.serving import serve

    for extra in ([tiny_model], ["smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"], [" "]):
        with pytest.raises(ConfigError):
            serve(model=tiny_model if extra == [tiny_model] else "tiny", storage=str(tmp_path), also_models=extra,
                  single_user=True)


def test_extra_model_calls_pass_the_same_queue_and_budget_checks(models, worker, tmp_path):
    """An extra model's call is a job on the one scheduler, charged to its key: a full tenant queue answers 429
    and a key past its budget 402, before any work, as on the main model."""
    _, teacher, teacher_worker = models
    forward = ForwardRequest(BASE_POLICY, _data(2, 1))
    with serve_in_thread(create_app(worker, storage=str(tmp_path / "a"), models={teacher: teacher_worker},
                                    max_pending_per_tenant=0)) as url:
        for name in (teacher, None):
            status, reply = _call(url, "", "forward", forward, model=name)
            assert status == 429 and "max_pending_per_tenant" in reply.error
    keys = KeyStore(ObjectStore(str(tmp_path / "b")))
    poor = keys.create("poor", budget_usd=0.01)
    with serve_in_thread(create_app(worker, keys=keys, storage=str(tmp_path / "b"), price_per_hour=3600.0,
                                    models={teacher: teacher_worker})) as url:
        status, reply = _call(url, poor, "forward", forward, model=teacher)
        assert status == 402 and reply.category == "user" and f"forward on {teacher}" in reply.error
        usage = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {poor}"}).json()
        assert usage["calls"] == 0 and usage["models"] == {}


def test_tokenizer_files_from_elsewhere_are_checked_before_anything_is_written(tmp_path):
    from tinkerless.errors import ProtocolError
    from tinkerless.functions.companions.tokenizer_files import tokenizer_from_files

    for hostile in (None, {}, [], {"../x.json": b"{}"}, {"/etc/passwd": b""}, {"..": b""}, {"a": "text"},
                    {3: b""}, {f"f{i}": b"" for i in range(40)}, {"big": b"x" * (65 * 1024 * 1024)}):
        with pytest.raises(ProtocolError, match="sent no tokenizer files"):
            tokenizer_from_files(hostile, source="the test")
    assert not (tmp_path.parent / "x.json").exists()
