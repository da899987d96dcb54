"""Agent functions on a shared multi-tenant server: they run in the tenant's sandbox and reach the model only
through their rollout's channel (functions/hosting/hosted_agents.py, agent_channel*.py).

A live `tinkerless serve` (multi-tenant, tiny model, 127.0.0.1) with two tenants. Bob's agents try what a
hostile agent would: garbage and oversized frames on the channel, a huge body, a thousand requests, keys that
are not theirs, models other than "policy", paths outside /v1, TCP to the server, the server's files and
environment. Each is stopped (a 4xx to the agent, or an error episode), and after each Alice is still served.
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import numpy as np
import pytest

import tinkerless
from tinkerless.functions.hosting.user_code import UserCodeHosts
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KEYS_FILE, KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message, encode_message, pack_code
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, ErrorReply, RolloutRequest, SampleRequest, SamplingParams

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def shared(tiny_model, tmp_path_factory):
    """(url, alice's key, bob's key, the server's storage dir, the worker) of a live shared server."""
    storage = tmp_path_factory.mktemp("shared-server")
    keys = KeyStore(ObjectStore(str(storage)))
    alice, bob = keys.create("alice"), keys.create("bob")
    hosts = UserCodeHosts(hide=(str(storage),))
    worker = Worker(tiny_model, user_code_hosts=hosts)
    os.environ["TINKERLESS_TEST_AGENT_SECRET"] = secrets.token_hex(8)
    try:
        with serve_in_thread(create_app(worker, keys=keys, storage=str(storage))) as url:
            yield url, alice, bob, storage, worker
    finally:
        os.environ.pop("TINKERLESS_TEST_AGENT_SECRET", None)
        hosts.close()


def rollout_request(agent, tasks, *, group_size=1, max_turns=4, timeout=60.0, temperature=0.0, seed=0) -> RolloutRequest:
    return RolloutRequest(policy=BASE_POLICY, tasks=tasks, group_size=group_size,
                          sampling=SamplingParams(max_tokens=5, temperature=temperature),
                          limits=EpisodeLimits(max_turns=max_turns, max_episode_tokens=512), seed=seed,
                          agent=pack_code(agent), agent_timeout=timeout)


def rollout(url: str, key: str, agent, tasks, **options):
    backend = HTTPBackend(url, api_key=key)
    try:
        reply = decode_message(backend.call_bytes("rollout", encode_message(rollout_request(agent, tasks, **options))))
    finally:
        backend.close()
    assert not isinstance(reply, ErrorReply), reply
    return reply


def alice_samples(url: str, alice: str) -> float:
    """Alice's `sample` works (the server keeps serving other tenants); its latency in seconds."""
    backend = HTTPBackend(url, api_key=alice)
    started = time.perf_counter()
    try:
        reply = decode_message(backend.call_bytes("sample", encode_message(
            SampleRequest(policy=BASE_POLICY, prompts=["hello"], sampling=SamplingParams(max_tokens=3, temperature=0.0)))))
    finally:
        backend.close()
    assert not isinstance(reply, ErrorReply), reply
    assert len(reply.sequences[0][0].tokens) >= 1
    return time.perf_counter() - started


@tinkerless.agent
async def two_turns_then_summary(client, task):
    """Two calls that continue one sequence, then a rewritten context (a second training sequence)."""
    messages = [{"role": "user", "content": task["q"]}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
    third = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "sum: " + task["q"]}])
    text = (second.choices[0].message.content or "") + (third.choices[0].message.content or "")
    return tinkerless.AgentResult(reward=float(sum(map(ord, text)) % 5), metrics={"chars": len(text)})


# Greedy: 4 copies whose calls are gathered into shared generate calls. Seeded sampling: one copy, because
# a gathered call's rows draw from (the first call's seed, row index), so which calls were gathered together
# (a matter of timing, in-process too) changes what several copies draw.
@pytest.mark.parametrize("temperature, tasks, group_size", [(0.0, [{"q": "a"}, {"q": "bc"}], 2), (1.0, [{"q": "a"}], 1)])
def test_a_sandboxed_agent_rollout_equals_the_in_process_one(shared, worker, temperature, tasks, group_size):
    url, alice, bob, storage, hosted_worker = shared
    options = dict(group_size=group_size, temperature=temperature, seed=7)
    local = worker.rollout(rollout_request(two_turns_then_summary, tasks, **options)).episodes  # in-process
    result = rollout(url, bob, two_turns_then_summary, tasks, **options)
    hosted, copies = result.episodes, len(tasks) * group_size
    assert result.stats["agent_requests"] == 3 * copies and hosted_worker._code_cache == {}  # never unpickled here
    assert [e.status for e in local] == [e.status for e in hosted] == ["ok"] * copies
    for a, b in zip(local, hosted):
        assert (a.reward, a.info, a.num_turns, a.transcript) == (b.reward, b.info, b.num_turns, b.transcript)
        assert a.tokens.tolist() == b.tokens.tolist() and a.mask.tolist() == b.mask.tolist()
        np.testing.assert_allclose(a.sampler_logprobs, b.sampler_logprobs, atol=1e-4)
        assert len(a.extra_sequences) == len(b.extra_sequences) == 1
        for x, y in zip(a.extra_sequences, b.extra_sequences):
            assert x.tokens.tolist() == y.tokens.tolist() and x.mask.tolist() == y.mask.tolist()
            np.testing.assert_allclose(x.sampler_logprobs, y.sampler_logprobs, atol=1e-4)


@tinkerless.agent
async def prying(client, task):
    """Reports where it runs and what it could reach; the reward is 1 only if it reached nothing."""
    import os as _os
    import socket as _socket

    found = {"uid": float(_os.getuid()), "pid": float(_os.getpid())}
    try:
        _socket.create_connection(("127.0.0.1", task["port"]), timeout=2).close()
        found["tcp_to_server"] = 1.0
    except OSError:
        found["tcp_to_server"] = 0.0
    for label, path in (("keys_file", task["keys"]), ("server_environ", f"/proc/{task['server_pid']}/environ")):
        try:
            open(path, "rb").read()
            found[label] = 1.0
        except OSError:
            found[label] = 0.0
    found["env_secret"] = float(task["secret"] in str(_os.environ))
    reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    found["model_reached"] = float(bool(reply.choices[0].message.content is not None))
    reached = found["tcp_to_server"] + found["keys_file"] + found["server_environ"] + found["env_secret"]
    return tinkerless.AgentResult(reward=1.0 if reached == 0 else 0.0, metrics=found)


def test_the_agent_runs_in_the_sandbox_and_reaches_only_the_model(shared):
    url, alice, bob, storage, _ = shared
    port = int(url.rsplit(":", 1)[1])
    task = {"port": port, "keys": str(storage / KEYS_FILE), "server_pid": os.getpid(),
            "secret": os.environ["TINKERLESS_TEST_AGENT_SECRET"]}
    (episode,) = rollout(url, bob, prying, [task]).episodes
    assert episode.status == "ok", episode.error
    found = episode.info["agent_metrics"]
    assert found["tcp_to_server"] == found["keys_file"] == found["server_environ"] == found["env_secret"] == 0.0, found
    assert found["model_reached"] == 1.0 and episode.reward == 1.0
    assert found["uid"] != os.getuid() and found["pid"] < 10  # its own uid, its own PID namespace
    alice_samples(url, alice)


@tinkerless.agent
async def knocking(client, task):
    """Asks for what it may not have; the metrics are the HTTP statuses it got."""
    import openai as _openai

    import tinkerless.functions.hosting.agent_channel as channel

    statuses = {}

    async def status_of(label, call):
        try:
            await call
            statuses[label] = 200.0
        except _openai.APIStatusError as exc:
            statuses[label] = float(exc.status_code)

    chat = client.chat.completions
    await status_of("other_model", chat.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]))
    await status_of("other_tenant_run", chat.create(model="alice-run@latest", messages=[{"role": "user", "content": "hi"}]))
    await status_of("huge_body", chat.create(model="policy", messages=[{"role": "user", "content": "x" * (4 * 2**20 + 2**19)}]))
    channel.MAX_BODY_BYTES = 2**30  # the transport is in the attacker's process: the worker must check too
    await status_of("huge_body_sent", chat.create(model="policy", messages=[{"role": "user", "content": "x" * (4 * 2**20 + 2**19)}]))
    channel.MAX_BODY_BYTES = 4 * 2**20
    for label, key in (("made_up_key", "episode-0-" + "A" * 24), ("stale_key", task.get("stale", "none"))):
        other = _openai.AsyncOpenAI(api_key=key, base_url=str(client.base_url), http_client=client._client, max_retries=0)
        await status_of(label, other.models.list())
    http = client._client
    auth = {"Authorization": f"Bearer {client.api_key}"}
    statuses["outside_v1"] = float((await http.get("http://tinkerless-worker/v2/models", headers=auth)).status_code)
    statuses["dot_dot"] = float((await http.get("http://tinkerless-worker/v1/../metrics", headers=auth)).status_code)
    statuses["delete"] = float((await http.delete("http://tinkerless-worker/v1/models", headers=auth)).status_code)
    many = {f"x-h{i}": "1" for i in range(80)}
    statuses["many_headers"] = float((await http.get("http://tinkerless-worker/v1/models", headers={**auth, **many})).status_code)
    await status_of("policy", chat.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    stream = await chat.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True)
    chunks = [chunk async for chunk in stream]  # server-sent events come back whole, and parse as a stream
    statuses["stream_chunks"] = float(len(chunks) >= 2)
    return tinkerless.AgentResult(reward=1.0, metrics=statuses)


@tinkerless.agent
async def remember_key(client, task):
    import builtins

    builtins._tinkerless_test_stale_key = client.api_key  # the host outlives the rollout (and the job thread that started it)
    return 0.0


@tinkerless.agent
async def knocking_with_stale_key(client, task):
    import builtins

    return await knocking(client, {"stale": builtins._tinkerless_test_stale_key})


def test_requests_outside_what_an_agent_may_ask_are_4xx_and_the_server_keeps_serving(shared):
    url, alice, bob, _, _ = shared
    (first,) = rollout(url, bob, remember_key, [{}]).episodes
    assert first.status == "ok", first.error
    (episode,) = rollout(url, bob, knocking_with_stale_key, [{}], max_turns=8).episodes
    assert episode.status == "ok", episode.error
    statuses = episode.info["agent_metrics"]
    assert statuses == {
        "other_model": 404.0, "other_tenant_run": 404.0, "huge_body": 413.0, "huge_body_sent": 413.0,
        "made_up_key": 401.0, "stale_key": 401.0, "outside_v1": 404.0, "dot_dot": 404.0, "delete": 405.0,
        "many_headers": 431.0, "policy": 200.0, "stream_chunks": 1.0,
    }, statuses
    alice_samples(url, alice)


@tinkerless.agent
async def flooding(client, task):
    import openai as _openai

    refused = 0
    for _ in range(1000):
        try:
            await client.models.list()
        except _openai.RateLimitError:
            refused += 1
    return tinkerless.AgentResult(reward=1.0, metrics={"refused": refused})


def test_a_thousand_requests_go_over_the_budget_and_end_the_episode(shared):
    url, alice, bob, _, _ = shared
    result = rollout(url, bob, flooding, [{}], max_turns=4)
    (episode,) = result.episodes
    assert episode.status == "error" and "more requests than this rollout allows" in episode.error
    assert result.stats["agent_requests"] == 1000  # 1 x (4 + 16) answered, the rest refused with 429
    alice_samples(url, alice)


@tinkerless.agent
async def garbage_on_the_channel(client, task):
    import struct as _struct

    sock = client._client._transport.sock
    frame = b"\xc1\xc1\xc1" if task["kind"] == "garbage" else b""  # 0xc1: never valid msgpack
    length = len(frame) if task["kind"] == "garbage" else 2**31
    sock.setblocking(True)
    sock.sendall(_struct.pack(">I", length) + frame)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    return 1.0


@pytest.mark.parametrize("kind", ["garbage", "oversized"])
def test_a_bad_frame_stops_the_host_and_the_next_rollout_gets_a_fresh_one(shared, kind):
    url, alice, bob, _, _ = shared
    episodes = rollout(url, bob, garbage_on_the_channel, [{"kind": kind}], group_size=2).episodes
    assert [e.status for e in episodes] == ["error", "error"]
    assert all("malformed frame" in e.error and "stopped" in e.error for e in episodes), episodes[0].error
    alice_samples(url, alice)
    (episode,) = rollout(url, bob, prying, [{"port": 1, "keys": "/nonexistent", "server_pid": 1, "secret": "x"}]).episodes
    assert episode.status == "ok", episode.error


@tinkerless.agent
async def slow_agent(client, task):
    import asyncio as _asyncio

    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    await _asyncio.sleep(task["sleep"])  # tool work: the model is free for other tenants meanwhile
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return 1.0


def test_another_tenant_is_served_while_an_agent_rollout_runs(shared):
    url, alice, bob, _, _ = shared
    rollout(url, bob, slow_agent, [{"sleep": 0.0}])  # bob's host is warm
    done: dict = {}
    thread = threading.Thread(target=lambda: done.update(r=rollout(url, bob, slow_agent, [{"sleep": 6.0}])))
    started = time.monotonic()
    thread.start()
    time.sleep(1.5)
    latency = alice_samples(url, alice)
    answered = time.monotonic() - started
    thread.join()
    assert done["r"].episodes[0].status == "ok"
    assert answered < 5.0, f"alice waited {latency:.1f}s, behind bob's whole rollout"


def test_frames_split_anywhere_decode_and_bad_ones_are_refused():
    from tinkerless.functions.hosting.agent_channel import MAX_FRAME_BYTES, FrameError, FrameReader, encode_frame

    frames = [{"id": 1, "method": "GET", "path": "/v1/models", "headers": [], "body": b""}, {"done": "k"}]
    data = b"".join(encode_frame(f) for f in frames)
    reader = FrameReader()
    got = [f for i in range(len(data)) for f in reader.feed(data[i:i + 1])]  # one byte at a time
    assert got == frames
    with pytest.raises(FrameError, match="over the limit"):
        FrameReader().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(FrameError, match="not msgpack"):
        FrameReader().feed(b"\x00\x00\x00\x03\xc1\xc1\xc1")
    with pytest.raises(FrameError, match="not msgpack"):  # an ext type: nothing is registered to decode one
        FrameReader().feed(b"\x00\x00\x00\x03\xd4\x05\x00")


def test_train_an_agent_through_the_shared_server(shared, tiny_model, tmp_path):
    url, alice, bob, storage, _ = shared
    result = tinkerless.train(
        model=tiny_model, agent=two_turns_then_summary, tasks=[{"q": "a"}, {"q": "b"}], steps=2, batch_size=2,
        group_size=2, max_tokens=4, storage=str(tmp_path), progress=False, learning_rate=1e-3, run_id="agent-run",
        backend=HTTPBackend(url, api_key=bob),
    )
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert all(m["episodes"] == 4 and m["episodes_error"] == 0 and "agent/chars" in m for m in result.metrics)
    assert (storage / "tenants/bob/runs/agent-run").is_dir()  # bob's run, trained from his sandboxed agent
