"""The wire: msgpack codec round trips, the protocol envelope, user code by value,
and the local backend going through real bytes with typed errors on the way back."""

from __future__ import annotations

import functools
import math
import threading

import msgpack
import numpy as np
import pytest
import torch

from tinkerless.errors import ProtocolError, RemoteError, UserCodeError, UserError
from tinkerless.functions.losses import LossConfig
from tinkerless.wire import (
    PROTOCOL_VERSION,
    PYTHON_VERSION,
    CodeBlob,
    decode,
    decode_message,
    encode,
    encode_message,
    pack_code,
    unpack_code,
)
from tinkerless.wire.messages import (
    AdamParams,
    Datum,
    Episode,
    EpisodeLimits,
    ErrorReply,
    ForwardRequest,
    LoraConfig,
    PolicyState,
    RolloutRequest,
    RolloutResult,
    SampledSequence,
    SampleRequest,
    SampleResult,
    SamplingParams,
    UpdateRequest,
)


def roundtrip(obj):
    data = encode(obj)
    assert isinstance(data, bytes)
    return decode(data)


def assert_arrays_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert isinstance(b, np.ndarray)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


# ---- codec ---------------------------------------------------------------------------------


ARRAYS = {
    "int32": np.arange(7, dtype=np.int32),
    "int64_2d": np.arange(12, dtype=np.int64).reshape(3, 4),
    "float32": np.linspace(-1, 1, 5, dtype=np.float32),
    "float16": np.array([0.5, -2.0, 65504.0], dtype=np.float16),
    "float64_with_nan": np.array([1.0, np.nan, np.inf, -np.inf]),
    "bool": np.array([True, False, True]),
    "uint8": np.frombuffer(b"\x00\x7f\xff", dtype=np.uint8),
    "empty_float32": np.zeros(0, dtype=np.float32),
    "empty_2d": np.zeros((0, 3), dtype=np.int32),
    "big_endian": np.arange(4, dtype=">i4"),
    "non_contiguous": np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2],
    "3d": np.arange(24, dtype=np.int16).reshape(2, 3, 4),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_array_round_trip_keeps_dtype_shape_and_values(name):
    array = ARRAYS[name]
    out = roundtrip(array)
    assert_arrays_equal(array, out)
    assert out.flags.writeable, "receivers get writable arrays"


def test_episode_round_trip_with_arrays_nan_and_nested_data():
    episode = Episode(
        task_index=3,
        tokens=np.array([5, 6, 7, 8], dtype=np.int32),
        mask=np.array([0, 0, 1, 1], dtype=np.float32),
        sampler_logprobs=np.zeros(0, dtype=np.float32),  # empty array
        prompt_length=2,
        reward=float("nan"),
        turn_rewards=[0.5, float("inf"), -1.0],
        num_turns=2,
        status="error",
        error="Env.step (turn 1): ValueError: boom",
        traceback="Traceback (most recent call last):\n  ...",
        transcript=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        info={"grid": np.eye(2, dtype=np.float64), "raw": b"\x00\x01\xff", "n": 1, "nested": {"a": [1, 2.5, None]}},
    )
    out = roundtrip(episode)
    assert isinstance(out, Episode)
    assert_arrays_equal(episode.tokens, out.tokens)
    assert_arrays_equal(episode.mask, out.mask)
    assert_arrays_equal(episode.sampler_logprobs, out.sampler_logprobs)
    assert math.isnan(out.reward)
    assert out.turn_rewards[0] == 0.5 and math.isinf(out.turn_rewards[1]) and out.turn_rewards[2] == -1.0
    assert (out.task_index, out.prompt_length, out.num_turns, out.status) == (3, 2, 2, "error")
    assert out.error == episode.error and out.traceback == episode.traceback
    assert out.transcript == episode.transcript
    assert_arrays_equal(episode.info["grid"], out.info["grid"])
    assert out.info["raw"] == b"\x00\x01\xff" and isinstance(out.info["raw"], bytes)
    assert out.info["nested"] == {"a": [1, 2.5, None]}


def test_nested_dataclasses_round_trip():
    request = RolloutRequest(
        policy="default",
        tasks=[{"prompt": "2+3?", "answer": 5}, {"prompt": "x", "meta": {"k": [1, 2]}}],
        group_size=4,
        sampling=SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, top_k=3),
        limits=EpisodeLimits(max_turns=3, max_episode_tokens=99),
        seed=7,
        env=None,
        reward=CodeBlob(name="r", python=PYTHON_VERSION, payload=b"\x80\x05binary"),
        system_prompt="be brief",
    )
    assert roundtrip(request) == request

    update = UpdateRequest(
        policy="p",
        data=[
            Datum(
                tokens=np.array([1, 2, 3], dtype=np.int32),
                mask=np.array([0, 1, 1], dtype=np.float32),
                advantages=np.array([0, 0.5, 0.5], dtype=np.float32),
            )
        ],
        loss=LossConfig(name="ppo", normalization="constant", normalization_constant=12.0, tis_cap=2.0),
        adam=AdamParams(learning_rate=1e-3, grad_clip_norm=1.0),
    )
    out = roundtrip(update)
    assert isinstance(out.loss, LossConfig) and out.loss == update.loss  # a frozen dataclass from another module
    assert out.adam == update.adam
    (datum,) = out.data
    assert isinstance(datum, Datum)
    assert_arrays_equal(update.data[0].tokens, datum.tokens)
    assert_arrays_equal(update.data[0].advantages, datum.advantages)
    assert datum.sampler_logprobs is None and datum.ref_logprobs is None

    sample = SampleResult([[SampledSequence([1, 2], [-0.1, float("nan")], "ab", "length")], []])
    out = roundtrip(sample)
    assert out.sequences[1] == [] and out.sequences[0][0].text == "ab"
    assert math.isnan(out.sequences[0][0].logprobs[1])

    state = PolicyState("default", {"adapter/adapter_model.safetensors": bytes(range(256)), "x.json": b"{}"}, 4)
    assert roundtrip(state) == state

    result = RolloutResult(episodes=[], stats={"seconds": 0.25})
    assert roundtrip(result) == result


def test_torch_tensors_encode_as_arrays():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_(True) * 2
    out = roundtrip({"logprobs": t, "ids": torch.tensor([1, 2, 3], dtype=torch.int64)})
    assert_arrays_equal(t.detach().numpy(), out["logprobs"])
    assert_arrays_equal(np.array([1, 2, 3], dtype=np.int64), out["ids"])


def test_zero_dim_array_keeps_its_shape():
    out = roundtrip(np.array(2.5, dtype=np.float32))
    assert out.shape == ()
    out = roundtrip(torch.tensor(1.5))  # e.g. a scalar loss tensor
    assert out.shape == ()


def test_bfloat16_tensor_encodes_or_is_refused_with_protocol_error():
    try:
        out = roundtrip(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    except ProtocolError:
        return
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), [1.0, 2.0])


def test_plain_values_round_trip():
    value = {"nan": float("nan"), "bytes": b"\x00\xff", "str": "héllo", "int_key": {1: "a"}, "none": None, "big": 2**62}
    out = roundtrip(value)
    assert math.isnan(out["nan"])
    assert out["bytes"] == b"\x00\xff" and isinstance(out["bytes"], bytes)
    assert out["str"] == "héllo" and out["int_key"] == {1: "a"} and out["none"] is None and out["big"] == 2**62
    assert roundtrip(np.float32(1.5)) == 1.5 and type(roundtrip(np.int64(3))) is int
    assert roundtrip({3, 1, 2}) == [1, 2, 3]


def test_unencodable_object_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="(?i)cannot encode a lock"):
        encode({"lock": threading.Lock()})
    with pytest.raises(ProtocolError, match="object arrays"):
        encode(np.array([object()], dtype=object))


# ---- envelope --------------------------------------------------------------------------------


def test_envelope_round_trip():
    body = SamplingParams(max_tokens=3)
    assert decode_message(encode_message(body)) == body
    envelope = decode(encode_message(body))
    assert envelope["v"] == PROTOCOL_VERSION and envelope["py"] == PYTHON_VERSION


def test_envelope_rejects_other_protocol_version_naming_both():
    other = PROTOCOL_VERSION + 1
    data = encode({"v": other, "py": PYTHON_VERSION, "body": {"x": 1}})
    with pytest.raises(ProtocolError) as info:
        decode_message(data)
    message = str(info.value)
    assert f"protocol version {other}" in message
    assert f"speaks {PROTOCOL_VERSION}" in message
    assert info.value.hint


@pytest.mark.parametrize(
    "garbage",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"not msgpack at all \xff\xfe",
        encode_message({"a": 1})[:-1],  # truncated
        encode_message({"a": 1}) + b"\x00",  # trailing data
        encode([1, 2, 3]),  # valid msgpack, no envelope
        encode({"body": 1}),  # envelope without a version
    ],
)
def test_malformed_bytes_are_protocol_errors(garbage):
    with pytest.raises(ProtocolError, match="malformed message"):
        decode_message(garbage)


def test_unknown_extension_type_is_refused():
    data = msgpack.packb({"v": PROTOCOL_VERSION, "body": msgpack.ExtType(42, b"xx")}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="extension type 42"):
        decode_message(data)


@pytest.mark.parametrize("tag", ["os:system", "subprocess:Popen", "tinkerless_evil.mod:Thing", "builtins:eval"])
def test_non_tinkerless_type_tags_are_refused(tag):
    payload = {"__dc__": tag, "command": "touch /tmp/tinkerless-pwned", "args": ["x"]}
    with pytest.raises(ProtocolError, match="refusing to rebuild non-tinkerless type"):
        decode(msgpack.packb(payload, use_bin_type=True))
    envelope = msgpack.packb({"v": PROTOCOL_VERSION, "py": PYTHON_VERSION, "body": payload}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="non-tinkerless"):
        decode_message(envelope)


def test_tinkerless_path_to_a_non_dataclass_is_not_called():
    # `os` is importable through tinkerless.functions.worker's namespace; it must never be called.
    payload = {"__dc__": "tinkerless.functions.worker:os.system", "command": "touch /tmp/tinkerless-pwned"}
    envelope = msgpack.packb({"v": PROTOCOL_VERSION, "body": payload}, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_message(envelope)


def test_decode_refuses_non_dataclass_tinkerless_paths_with_protocol_error():
    with pytest.raises(ProtocolError):
        decode(msgpack.packb({"__dc__": "tinkerless.functions.worker:os.system", "command": "true"}))


def test_unknown_tinkerless_type_names_the_tag():
    payload = {"__dc__": "tinkerless.wire.messages:NoSuchMessage"}
    with pytest.raises(ProtocolError, match="unknown wire type") as info:
        decode(msgpack.packb(payload))
    assert "NoSuchMessage" in str(info.value)


def test_unknown_fields_are_dropped():
    data = msgpack.packb({"__dc__": "tinkerless.wire.messages:SamplingParams", "max_tokens": 5, "from_the_future": 1})
    assert decode(data) == SamplingParams(max_tokens=5)


# ---- user code by value ----------------------------------------------------------------------


class Counter:
    def __init__(self, start: int = 0):
        self.value = start

    def bump(self) -> int:
        self.value += 1
        return self.value


def test_pack_code_round_trips_closure_lambda_and_class():
    offset = 10
    table = {"a": 1}

    def closure(x: int) -> int:
        return x + offset + table["a"]

    blob = pack_code(closure)
    assert blob.python == PYTHON_VERSION and isinstance(blob.payload, bytes)
    assert "closure" in blob.name
    # through the codec too: a CodeBlob is what travels inside requests
    rebuilt = unpack_code(roundtrip(blob))
    assert rebuilt is not closure and rebuilt(1) == 12

    square = unpack_code(pack_code(lambda x: x * x, name="square"))
    assert square(7) == 49

    cls = unpack_code(pack_code(Counter))
    c = cls(5)
    assert c.bump() == 6 and cls.__name__ == "Counter"


def test_pack_code_round_trips_functools_partial():
    import cloudpickle

    def add(a, b):
        return a + b

    try:
        partial = unpack_code(pack_code(functools.partial(add, 2)))
        assert partial(3) == 5
    finally:  # do not leave the stdlib registered by value for the rest of the session
        for module in ("functools",):
            try:
                cloudpickle.unregister_pickle_by_value(__import__(module))
            except ValueError:
                pass


def test_unpack_code_refuses_another_python_minor_version():
    blob = pack_code(lambda: 1, name="my_reward")
    major, minor = PYTHON_VERSION.split(".")
    other = f"{major}.{int(minor) + 1}"
    blob = CodeBlob(name=blob.name, python=other, payload=blob.payload)
    with pytest.raises(ProtocolError) as info:
        unpack_code(blob)
    message = str(info.value)
    assert f"Python {other}" in message and f"Python {PYTHON_VERSION}" in message
    assert "my_reward" in message


def test_unpicklable_closure_is_a_user_code_error_naming_the_object():
    lock = threading.Lock()

    def guarded_reward(completion, task):
        with lock:
            return 1.0

    with pytest.raises(UserCodeError) as info:
        pack_code(guarded_reward)
    message = str(info.value)
    assert "guarded_reward" in message
    assert "lock" in message.lower()
    assert info.value.hint and "cloudpickle" in info.value.hint


def test_function_closing_over_an_open_file_is_a_user_code_error(tmp_path):
    handle = open(tmp_path / "log.txt", "w")
    try:

        def logging_reward(completion, task):
            handle.write(completion)
            return 0.0

        with pytest.raises(UserCodeError, match="logging_reward"):
            pack_code(logging_reward)
    finally:
        handle.close()


def test_unpack_code_with_corrupt_payload_is_a_user_code_error():
    with pytest.raises(UserCodeError, match="cannot unpack 'broken'"):
        unpack_code(CodeBlob(name="broken", python=PYTHON_VERSION, payload=b"\x80\x05not a pickle"))


# ---- the local backend speaks bytes -----------------------------------------------------------


class RecordingBackend:
    """Wraps a real backend and keeps every payload it sent and received."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.calls: list[tuple[str, bytes, bytes]] = []

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        reply = self.inner.call_bytes(method, payload)
        self.calls.append((method, payload, reply))
        return reply

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def local_backend(tiny_model):
    from tinkerless.sdk.backends.base import LocalBackend

    return LocalBackend(tiny_model)


def test_local_backend_round_trips_requests_as_bytes(local_backend, tiny_model):
    from tinkerless.sdk.backends.base import call

    backend = RecordingBackend(local_backend)
    info = call(backend, "info", {})
    assert info["model"] == tiny_model

    result = call(
        backend,
        "sample",
        SampleRequest(policy="base", prompts=["hi", [1, 2, 3]], num_samples=2, sampling=SamplingParams(max_tokens=4), seed=1),
    )
    assert isinstance(result, SampleResult)
    assert [len(group) for group in result.sequences] == [2, 2]
    for seq in result.sequences[0] + result.sequences[1]:
        assert isinstance(seq, SampledSequence)
        assert 1 <= len(seq.tokens) <= 4 and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")

    method, payload, reply = backend.calls[-1]
    assert method == "sample" and isinstance(payload, bytes) and isinstance(reply, bytes)
    assert decode_message(payload).prompts == ["hi", [1, 2, 3]]
    assert decode_message(reply) == result  # the caller got exactly what was on the wire


def test_local_backend_rollout_with_packed_reward(local_backend):
    from tinkerless.sdk.backends.base import call

    def length_reward(completion, task):
        return float(len(completion)) + task["bonus"]

    request = RolloutRequest(
        policy="base",
        tasks=[{"prompt": "a", "bonus": 1.0}, {"prompt": "b", "bonus": 2.0}],
        group_size=2,
        sampling=SamplingParams(max_tokens=4),
        limits=EpisodeLimits(),
        seed=0,
        reward=pack_code(length_reward),
    )
    result = call(local_backend, "rollout", request)
    assert isinstance(result, RolloutResult) and len(result.episodes) == 4
    for episode in result.episodes:
        assert episode.status == "ok", episode.error
        assert episode.tokens.dtype == np.int32 and episode.mask.dtype == np.float32
        assert episode.tokens.shape == episode.mask.shape == episode.sampler_logprobs.shape
        completion = episode.transcript[-1]["content"]
        assert episode.reward == len(completion) + (1.0 if episode.task_index == 0 else 2.0)


def test_unknown_policy_comes_back_as_user_error(local_backend):
    from tinkerless.sdk.backends.base import call

    with pytest.raises(UserError, match="policy 'nope' does not exist") as info:
        call(local_backend, "sample", SampleRequest(policy="nope", prompts=["hi"], sampling=SamplingParams(max_tokens=2)))
    assert type(info.value) is UserError
    assert info.value.hint and "create_policy" in info.value.hint
    assert "Traceback" in info.value.remote_traceback


def test_unknown_method_comes_back_as_user_error(local_backend):
    from tinkerless.sdk.backends.base import call

    with pytest.raises(UserError, match="unknown function 'launch_missiles'"):
        call(local_backend, "launch_missiles", {})


def test_garbage_bytes_come_back_as_protocol_error_reply(local_backend):
    from tinkerless.sdk.backends.base import raise_error_reply

    reply = decode_message(local_backend.call_bytes("info", b"\xc1garbage"))
    assert isinstance(reply, ErrorReply)
    assert reply.type == "ProtocolError" and reply.category == "user"
    assert "malformed message" in reply.error
    with pytest.raises(ProtocolError, match="malformed message"):
        raise_error_reply(reply, where="local info")


def test_wrong_protocol_version_and_foreign_type_are_refused_by_the_worker(local_backend):
    from tinkerless.sdk.backends.base import raise_error_reply

    other = encode({"v": PROTOCOL_VERSION + 7, "py": PYTHON_VERSION, "body": {}})
    reply = decode_message(local_backend.call_bytes("info", other))
    assert reply.type == "ProtocolError" and str(PROTOCOL_VERSION + 7) in reply.error
    with pytest.raises(ProtocolError, match=f"speaks {PROTOCOL_VERSION}"):
        raise_error_reply(reply, where="local info")

    evil = msgpack.packb(
        {"v": PROTOCOL_VERSION, "body": {"__dc__": "os:system", "command": "touch /tmp/tinkerless-pwned"}},
        use_bin_type=True,
    )
    reply = decode_message(local_backend.call_bytes("create_policy", evil))
    assert reply.type == "ProtocolError" and "os:system" in reply.error


def test_a_token_id_outside_the_vocabulary_is_the_callers_error(local_backend):
    from tinkerless.errors import InvalidRequest
    from tinkerless.sdk.backends.base import call

    datum = Datum(tokens=np.array([1, 10**6], dtype=np.int32), mask=np.ones(2, dtype=np.float32))
    with pytest.raises(InvalidRequest, match="token id 1000000, outside this model's vocabulary") as info:
        call(local_backend, "forward", ForwardRequest("base", [datum]))
    assert info.value.category == "user"


def test_server_side_crash_comes_back_as_remote_error(local_backend, monkeypatch):
    from tinkerless.sdk.backends.base import call

    def crash(request):  # a bug inside the worker, past validation
        raise RuntimeError("index out of range in self")

    monkeypatch.setattr(local_backend.worker, "forward", crash)
    datum = Datum(tokens=np.array([1, 2], dtype=np.int32), mask=np.ones(2, dtype=np.float32))
    with pytest.raises(RemoteError) as info:
        call(local_backend, "forward", ForwardRequest("base", [datum]))
    error = info.value
    assert error.category == "server" and error.remote_type
    assert "local forward failed" in str(error)
    assert "Traceback" in error.remote_traceback


def test_code_blob_from_another_python_is_refused_by_the_worker(local_backend):
    from tinkerless.sdk.backends.base import call

    major, minor = PYTHON_VERSION.split(".")
    other = f"{major}.{int(minor) - 1}"
    blob = pack_code(lambda completion, task: 1.0, name="old_reward")
    request = RolloutRequest(
        policy="base",
        tasks=[{"prompt": "a"}],
        group_size=1,
        sampling=SamplingParams(max_tokens=2),
        limits=EpisodeLimits(),
        seed=0,
        reward=CodeBlob(blob.name, other, blob.payload),
    )
    with pytest.raises(ProtocolError) as info:
        call(local_backend, "rollout", request)
    assert f"Python {other}" in str(info.value) and f"Python {PYTHON_VERSION}" in str(info.value)


def test_lora_config_and_error_reply_round_trip():
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    assert roundtrip(lora) == lora
    reply = ErrorReply(error="x", category="user", type="DatasetError", traceback="tb", hint=None)
    assert decode_message(encode_message(reply)) == reply


def test_a_request_of_the_wrong_type_is_a_protocol_error(worker):
    from tinkerless.sdk.backends.base import call as backend_call

    class _Direct:
        name = "direct"

        def call_bytes(self, method, payload):
            return worker.handle(method, payload)

    with pytest.raises(ProtocolError, match="forward expects a ForwardRequest, got dict"):
        backend_call(_Direct(), "forward", {"not": "a request"})


def test_arrays_of_every_kind_in_one_message_keep_their_own_bytes():
    """Contiguous arrays, strided views and torch tensors share one frame; each must read back its own data."""
    import torch

    strided = np.arange(6, dtype=np.float32).reshape(2, 3).T
    values = [strided, np.arange(4, dtype=np.int64), torch.arange(3, dtype=torch.int32), np.eye(2)[:, ::-1], np.ones(2)]
    out = decode(encode(values))
    for sent, got in zip(values, out):
        expected = sent.numpy() if isinstance(sent, torch.Tensor) else sent
        assert got.dtype == expected.dtype and np.array_equal(got, expected)


def test_an_error_reply_comes_back_as_its_own_class_or_a_remote_error_never_a_type_error():
    """A class this side knows is raised as itself; one whose constructor takes other arguments (SequenceReused)
    or one this side does not know comes back as a RemoteError keeping the remote type, hint and traceback."""
    from tinkerless.errors import ConfigError, RemoteError, SequenceReused
    from tinkerless.wire.replies import error_reply, raise_error_reply

    for exc, expected in ((ConfigError("bad", hint="fix it"), ConfigError), (SequenceReused(3, 5), RemoteError),
                          (ValueError("boom"), RemoteError)):
        try:
            raise exc
        except Exception as caught:  # noqa: BLE001 - error_reply reads the traceback being handled
            reply = error_reply(caught)
        with pytest.raises(expected) as raised:
            raise_error_reply(reply, where="rank 0 update")
        assert raised.value.remote_traceback == reply.traceback and type(exc).__name__ in reply.traceback
        if expected is RemoteError:
            assert raised.value.remote_type == type(exc).__name__ and "rank 0 update failed" in str(raised.value)
        else:
            assert raised.value.hint == "fix it"
