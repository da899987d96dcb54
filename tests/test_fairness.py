"""One tenant never blocks another: time slices, round-robin slices, quotas, per-request limits.

Ordering, not wall-clock: jobs here wait on events to make interleavings certain, and the
server test checks that tenant B's small calls finish while tenant A's maximal request is
still running. Latency figures live in bench/flood.py (BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tinkerless.functions.sampling.slicing import slice_due, yield_slice
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.server.scheduler import QueueFull, Scheduler
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import (
    Seat,
    ResetPolicyRequest,
    EpisodeLimits,
    ErrorReply,
    MultiAgentRolloutRequest,
    RolloutRequest,
    SampleRequest,
    SamplingParams,
    SampleResult,
)
from tinkerless.wire.code import pack_code

MSGPACK = {"Content-Type": "application/msgpack"}


def sliced_job(name: str, steps: int, events: list, *, wait_at: int | None = None, reached=None, go=None):
    """A job of `steps` steps with a safe point after each, as the engine's decode loop has;
    at step `wait_at` it sets `reached` and waits for `go`."""

    def run():
        for step in range(steps):
            if step == wait_at:
                reached.set()
                assert go.wait(10)
            events.append((name, step))
            if slice_due():
                yield_slice()
        return name

    return run


def gate(scheduler: Scheduler) -> threading.Event:
    """Park the scheduler on a first job so the test can queue work; returns the release event."""
    release, started = threading.Event(), threading.Event()
    scheduler.submit(lambda: (started.set(), release.wait(10)), tenant="gate")
    assert started.wait(5)
    return release


def test_a_long_job_pauses_for_another_tenants_small_call():
    scheduler = Scheduler(slice_seconds=0)
    events: list = []
    reached, queued = threading.Event(), threading.Event()
    long = scheduler.submit(sliced_job("a", 10, events, wait_at=3, reached=reached, go=queued), tenant="alice")
    assert reached.wait(10)  # alice's job is mid-way: steps 0-2 ran with nobody else waiting
    small = scheduler.submit(lambda: events.append(("b", 0)) or "b", tenant="bob")
    queued.set()  # alice's job reaches its next safe point only now, with bob's call queued
    assert small.result(10) == "b" and long.result(10) == "a"
    assert events.index(("b", 0)) == 4  # right after alice's step 3: one slice, not her whole job
    assert scheduler.slices >= 1
    scheduler.close()


def test_slices_of_long_jobs_take_turns_between_tenants():
    scheduler = Scheduler(slice_seconds=0)
    release = gate(scheduler)
    events: list = []
    futures = [scheduler.submit(sliced_job(name, 4, events), tenant=name) for name in ("alice", "bob", "carol")]
    release.set()
    assert [f.result(10) for f in futures] == ["alice", "bob", "carol"]
    assert events == [(name, step) for step in range(4) for name in ("alice", "bob", "carol")]
    scheduler.close()


def test_a_tenants_own_calls_stay_in_order_around_its_paused_job():
    scheduler = Scheduler(slice_seconds=0)
    release = gate(scheduler)
    events: list = []
    first = scheduler.submit(sliced_job("a1", 3, events), tenant="alice", stream="s", seq=1)
    second = scheduler.submit(lambda: events.append(("a2", 0)), tenant="alice", stream="s", seq=2)
    other = scheduler.submit(sliced_job("b", 3, events), tenant="bob")
    release.set()
    for f in (first, second, other):
        f.result(10)
    alice = [e for e in events if e[0].startswith("a")]
    assert alice == [("a1", 0), ("a1", 1), ("a1", 2), ("a2", 0)]  # seq 2 never overtakes paused seq 1
    assert events.index(("b", 0)) < events.index(("a1", 2))  # while bob's slices interleave
    scheduler.close()


def test_a_job_alone_is_never_paused():
    scheduler = Scheduler(slice_seconds=0)
    events: list = []
    assert scheduler.submit(sliced_job("a", 5, events), tenant="alice").result(10) == "a"
    assert scheduler.slices == 0
    scheduler.close()


def test_a_tenant_over_its_quota_gets_429_while_others_still_get_in():
    scheduler = Scheduler(max_pending_per_tenant=2)
    release = gate(scheduler)
    accepted = [scheduler.submit(lambda: 1, tenant="alice") for _ in range(2)]
    with pytest.raises(QueueFull, match="max_pending_per_tenant=2") as full:
        scheduler.submit(lambda: 3, tenant="alice")
    assert 1.0 <= full.value.retry_after <= 30.0
    bob = scheduler.submit(lambda: "bob", tenant="bob")  # bob's own quota is untouched
    release.set()
    assert [f.result(5) for f in accepted] == [1, 1] and bob.result(5) == "bob"
    assert scheduler.submit(lambda: 4, tenant="alice").result(5) == 4  # room again once hers finish
    scheduler.close()


# -- over HTTP ---------------------------------------------------------------------------------


class SlowWorker:
    """A test double: "slow" holds the model until released; info reads no model."""

    MODEL_FREE_METHODS = ("info",)

    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Event()

    def handle(self, method: str, payload: bytes) -> bytes:
        if method == "slow":
            self.entered.set()
            self.release.wait(20)
        return encode_message({"ok": method})

    def info(self, _request=None) -> dict:
        return {"model": "slow", "policies": {}}


def test_info_answers_while_a_call_that_cannot_be_sliced_holds_the_model(tmp_path):
    worker = SlowWorker()
    with serve_in_thread(create_app(worker)) as url, httpx.Client(base_url=url, timeout=30) as client:
        holder = threading.Thread(target=client.post, args=("/v1/call/slow",), kwargs={"content": encode_message({}), "headers": MSGPACK})
        holder.start()
        assert worker.entered.wait(10)
        reply = client.post("/v1/call/info", content=encode_message(None), headers=MSGPACK)
        assert reply.status_code == 200 and decode_message(reply.content)["ok"] == "info"
        assert holder.is_alive()  # the slow call is still running: info did not queue behind it
        worker.release.set()
        holder.join(10)


def test_a_tenant_over_its_quota_gets_http_429_with_retry_after(tmp_path):
    keys = KeyStore(ObjectStore(str(tmp_path)))
    alice, bob = keys.create("alice"), keys.create("bob")
    worker = SlowWorker()
    app = create_app(worker, keys=keys, max_pending_per_tenant=1)
    request = encode_message(ResetPolicyRequest("p"))  # a tenant's body must be a request type to get queued
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        auth = lambda key: {**MSGPACK, "Authorization": f"Bearer {key}"}  # noqa: E731
        holder = threading.Thread(target=client.post, args=("/v1/call/slow",),
                                  kwargs={"content": request, "headers": auth(alice)})
        holder.start()
        assert worker.entered.wait(10)
        refused = client.post("/v1/call/fast", content=request, headers=auth(alice))
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = decode_message(refused.content)
        assert isinstance(error, ErrorReply) and "max_pending_per_tenant" in error.error
        queued = threading.Thread(target=client.post, args=("/v1/call/fast",),
                                  kwargs={"content": request, "headers": auth(bob)})
        queued.start()  # bob is not refused: his call queues behind alice's running one
        time.sleep(0.2)
        assert app.state.scheduler.pending == 1
        worker.release.set()
        holder.join(10)
        queued.join(10)


# -- limits and slices on a real worker -----------------------------------------------------

SMALL_LIMITS = ServingLimits(max_tokens=32, max_samples=4, max_prompt_tokens=16, max_group_size=3, max_rollouts=6)


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("limits")
    keys = KeyStore(ObjectStore(str(root)))
    key = keys.create("alice")
    app = create_app(Worker(tiny_model), keys=keys, storage=str(root), limits=SMALL_LIMITS)
    with serve_in_thread(app) as url:
        yield url, key, tiny_model


def call(url: str, key: str, method: str, request) -> tuple[int, object]:
    reply = httpx.post(f"{url}/v1/call/{method}", content=encode_message(request),
                       headers={**MSGPACK, "Authorization": f"Bearer {key}"}, timeout=60)
    return reply.status_code, decode_message(reply.content)


def _rollout(tasks: int, group_size: int, max_tokens: int = 4, episode_tokens: int = 40) -> RolloutRequest:
    return RolloutRequest("base", [{"prompt": "hi"}] * tasks, group_size, SamplingParams(max_tokens=max_tokens),
                          EpisodeLimits(max_turns=1, max_episode_tokens=episode_tokens), seed=0)


OVER_LIMIT_CALLS = {
    "sample: prompts x num_samples": ("sample", SampleRequest("base", [[3, 4]] * 3, num_samples=2, sampling=SamplingParams(max_tokens=4)), "max_samples"),
    "sample: max_tokens": ("sample", SampleRequest("base", [[3, 4]], sampling=SamplingParams(max_tokens=33)), "max_tokens"),
    "sample: token prompt": ("sample", SampleRequest("base", [list(range(3, 20))], sampling=SamplingParams(max_tokens=4)), "max_prompt_tokens"),
    "sample: text prompt": ("sample", SampleRequest("base", ["a long prompt " * 4], sampling=SamplingParams(max_tokens=4)), "max_prompt_tokens"),
    "rollout: group_size": ("rollout", _rollout(1, 4), "max_group_size"),
    "rollout: tasks x group_size": ("rollout", _rollout(3, 3), "max_rollouts"),
    "rollout: max_tokens": ("rollout", _rollout(1, 2, max_tokens=33), "max_tokens"),
    "rollout: max_episode_tokens": ("rollout", _rollout(1, 2, episode_tokens=49), "max_tokens"),
    "rollout_multi: group_size": (
        "rollout_multi",
        # (a valid request but for its size: every value is checked before the limits are)
        MultiAgentRolloutRequest([{}], 4, pack_code(SlowWorker), {"a": Seat("base", trainable=False)},
                                 SamplingParams(max_tokens=4), EpisodeLimits(), 0),
        "max_group_size",
    ),
}


@pytest.mark.parametrize("method,request_,limit", list(OVER_LIMIT_CALLS.values()), ids=list(OVER_LIMIT_CALLS))
def test_a_call_over_a_limit_is_a_user_error_naming_the_limit_and_its_flag(limited_server, method, request_, limit):
    url, key, _ = limited_server
    status, error = call(url, key, method, request_)
    assert status == 400 and isinstance(error, ErrorReply) and error.category == "user"
    assert limit in error.error and ServingLimits.flag(limit) in error.hint


def test_calls_at_the_limits_run(limited_server):
    url, key, _ = limited_server
    status, result = call(url, key, "sample", SampleRequest("base", [list(range(3, 19))] * 2, num_samples=2,
                                                             sampling=SamplingParams(max_tokens=32, stop_token_ids=[])))
    assert status == 200 and isinstance(result, SampleResult)
    assert [len(s.tokens) for group in result.sequences for s in group] == [32] * 4
    status, result = call(url, key, "rollout", _rollout(2, 3, max_tokens=32, episode_tokens=48))
    assert status == 200 and len(result.episodes) == 6


def test_tinker_asample_over_a_limit_is_refused_naming_the_limit(limited_server):
    tinker = pytest.importorskip("tinker")
    from tinker import types

    os.environ["TINKER_TELEMETRY"] = "0"
    url, key, model = limited_server
    client = tinker.ServiceClient(base_url=url, api_key=key)
    sampler = client.create_sampling_client(base_model=model).result()
    cases = [
        ([3, 4], 5, types.SamplingParams(max_tokens=4), "max-samples"),
        ([3, 4], 1, types.SamplingParams(max_tokens=33), "max-tokens"),
        (list(range(3, 20)), 1, types.SamplingParams(max_tokens=4), "max-prompt-tokens"),
    ]
    for prompt, n, params, flag in cases:
        with pytest.raises(tinker.TinkerError, match=flag):
            sampler.sample(types.ModelInput.from_ints(prompt), n, params).result(timeout=60)
    ok = sampler.sample(types.ModelInput.from_ints(list(range(3, 19))), 4, types.SamplingParams(max_tokens=32, stop=[]))
    assert [len(s.tokens) for s in ok.result(timeout=60).sequences] == [32] * 4
    client.close(status="success")


def test_a_small_call_finishes_while_another_tenants_maximal_request_runs(tmp_path, tiny_model):
    """Tenant A asks the Tinker API for a maximal sample; tenant B's info and small sample come back before it ends."""
    tinker = pytest.importorskip("tinker")
    from tinker import types

    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.sdk.backends.base import call as backend_call

    os.environ["TINKER_TELEMETRY"] = "0"
    keys = KeyStore(ObjectStore(str(tmp_path)))
    alice, bob = keys.create("alice"), keys.create("bob")
    limits = ServingLimits(max_tokens=200, max_samples=4)
    app = create_app(Worker(tiny_model), keys=keys, storage=str(tmp_path), limits=limits)
    scheduler = app.state.scheduler
    with serve_in_thread(app) as url:
        client = tinker.ServiceClient(base_url=url, api_key=alice)
        sampler = client.create_sampling_client(base_model=tiny_model).result()
        maximal = sampler.sample(types.ModelInput.from_ints([3, 4, 5]), 4,
                                 types.SamplingParams(max_tokens=200, stop=[], seed=1))
        deadline = time.monotonic() + 30
        while scheduler.in_flight == 0 and time.monotonic() < deadline:  # A's generation has started
            time.sleep(0.01)
        backend = HTTPBackend(url, api_key=bob)
        info = backend_call(backend, "info", None)
        small = backend_call(backend, "sample", SampleRequest("base", [[3, 4]], sampling=SamplingParams(max_tokens=4)))
        assert info["model"] and len(small.sequences[0][0].tokens) <= 4
        alices = [future for tenant, future, _ in app.state.tinker.futures.values() if tenant == "alice"]
        assert len(alices) == 1 and not alices[0].done(), "tenant B's calls waited for tenant A's whole request"
        assert scheduler.slices >= 1
        sequences = maximal.result(timeout=300).sequences  # and A's request still completes, whole
        assert [len(s.tokens) for s in sequences] == [200] * 4
        backend.close()
        client.close(status="success")


def test_serve_flags_reach_the_limits(monkeypatch):
    from tinkerless.sdk.cli import commands as cli

    captured = {}
    monkeypatch.setattr("tinkerless.server.serve", lambda *a, **k: captured.update(k))
    assert cli.main(["serve", "--no-auth", "--max-tokens", "100", "--max-samples", "7", "--max-group-size", "5",
                     "--max-pending-per-tenant", "9", "--slice-seconds", "0.2"]) == 0
    assert captured["limits"] == ServingLimits(max_tokens=100, max_samples=7, max_group_size=5)
    assert captured["max_pending_per_tenant"] == 9 and captured["slice_seconds"] == 0.2
    assert cli.main(["serve", "--no-auth", "--max-tokens", "0"]) != 0  # a clear error, not a traceback
