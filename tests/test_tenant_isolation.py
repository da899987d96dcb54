"""On a shared server, a tenant's env/reward code runs in a sandbox of its own, never in the server process.

The reward below tries what issue #12 found a tenant could do: list `tenants/`, read
another tenant's run state, read the API-key store, read the server's environment. In
the sandbox it gets nothing, the episodes it ran in fail with the error recorded, and
the run completes. The same reward in a single-user (in-process) server does get
the secrets: that is what makes the first half of the test mean something.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

import pytest

import tinkerless
from tinkerless.functions.hosting.user_code import UserCodeHosts
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.keys import KEYS_FILE, KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire import pack_code

pytestmark = pytest.mark.timeout(300)


def prying_reward_for(server: str, server_pid: int):
    """A reward that, on tasks marked "pry", reads everything it should not and raises with what it found."""

    def reward(completion, task) -> float:
        if not task.get("pry"):
            return float(len(completion) % 3)
        import os as _os

        attempts = {
            "tenants": lambda: _os.listdir(f"{server}/tenants"),
            "alice state": lambda: open(f"{server}/tenants/alice/runs/secret-run/state.json").read(),
            "key store": lambda: open(f"{server}/server/api_keys.json").read(),
            "server env var": lambda: _os.environ["TINKERLESS_TEST_SERVER_SECRET"],
            "server environ": lambda: open(f"/proc/{server_pid}/environ", "rb").read().decode("latin-1"),
            "pid 1 environ": lambda: open("/proc/1/environ", "rb").read().decode("latin-1"),
        }
        found = {}
        for label, attempt in attempts.items():
            try:
                found[label] = "GOT " + str(attempt())
            except Exception as exc:
                found[label] = f"refused {type(exc).__name__}"
        raise RuntimeError(f"pried: {found}")

    return reward


def run_as(tiny_model, url: str, key: str, storage: Path, reward, run_id: str):
    return tinkerless.train(
        model=tiny_model, name="pry", reward=reward, tasks=[{"prompt": "hi"}, {"prompt": "hi", "pry": True}], steps=1,
        batch_size=2, group_size=2, max_tokens=4, storage=str(storage), progress=False, run_id=run_id,
        backend=HTTPBackend(url, api_key=key), on_env_error="skip",
    )


def recorded_errors(result) -> str:
    return json.dumps([e for record in result.metrics for e in record.get("errors", [])])


@pytest.fixture
def shared_server(tmp_path, monkeypatch):
    server = tmp_path / "server"
    keys = KeyStore(ObjectStore(str(server)))
    alice, bob = keys.create("alice"), keys.create("bob")
    token = secrets.token_hex(16)
    monkeypatch.setenv("TINKERLESS_TEST_SERVER_SECRET", token)
    return server, keys, alice, bob, token


def test_a_tenants_reward_reads_nothing_and_its_run_completes(tiny_model, tmp_path, shared_server):
    server, keys, alice, bob, token = shared_server
    hosts = UserCodeHosts(hide=(str(server),))
    worker = Worker(tiny_model, user_code_hosts=hosts)
    try:
        with running(create_app(worker, keys=keys, storage=str(server))) as url:
            run_as(tiny_model, url, alice, tmp_path / "alice", lambda c, t: 1.0, "secret-run")
            alice_state = (server / "tenants/alice/runs/secret-run/state.json").read_text()
            key_digest = json.loads((server / KEYS_FILE).read_text())[0]["sha256"]
            result = run_as(tiny_model, url, bob, tmp_path / "bob", prying_reward_for(str(server), os.getpid()), "pry-run")
        assert json.loads((server / "tenants/bob/runs/pry-run/state.json").read_text())["status"] == "finished"
        errors = recorded_errors(result)
        assert "pried:" in errors and "refused" in errors, errors
        assert "GOT" not in errors, f"the sandboxed reward read something: {errors}"
        for secret in (token, key_digest, alice_state[:40]):
            assert secret not in errors
        assert worker._code_cache == {}, "the server process never unpickled the tenants' code"
    finally:
        hosts.close()


def test_the_server_process_never_unpickles_tenant_code(tiny_model, tmp_path, shared_server):
    server, keys, alice, bob, token = shared_server
    marker = tmp_path / "unpickled-in-the-server"

    class Planted:  # unpickling it runs os.makedirs(marker): a side effect the server must never see
        def __reduce__(self):
            return (os.makedirs, (str(marker),))

    hosts = UserCodeHosts(hide=(str(server),))
    worker = Worker(tiny_model, user_code_hosts=hosts)
    try:
        from tinkerless.functions.hosting.user_code import HostedCodeError, tenant_scope

        with tenant_scope("bob"):
            loaded = worker._load_code(pack_code(Planted()))
            with pytest.raises(HostedCodeError, match="NoneType"):
                loaded("completion", {})  # what unpickling produced (None) is in the host, not here
        assert not marker.exists()
    finally:
        hosts.close()


def test_single_user_server_keeps_user_code_in_process(tiny_model, tmp_path, shared_server):
    """The positive control: in-process, the very same reward reads the secrets (hence --single-user is opt-in)."""
    server, keys, alice, bob, token = shared_server
    with running(create_app(Worker(tiny_model), keys=keys, storage=str(server))) as url:
        run_as(tiny_model, url, alice, tmp_path / "alice", lambda c, t: 1.0, "secret-run")
        result = run_as(tiny_model, url, bob, tmp_path / "bob", prying_reward_for(str(server), os.getpid()), "pry-run")
    errors = recorded_errors(result)
    assert token in errors and "GOT" in errors


# ---------------------------------------------------------------------------
# the same rollouts, hosted or in-process: the sandbox changes where code runs, not what it computes


class CountdownEnv:
    """Multi-turn: replies with how many turns are left; rewards the length of each reply."""

    def system_prompt(self) -> str:
        return "Count down."

    def reset(self, start: int) -> str:
        self.left = start
        return f"start at {start}"

    def step(self, action: str):
        from tinkerless.envs.base import StepResult

        self.left -= 1
        return StepResult(None if self.left <= 0 else f"{self.left} left", reward=len(action) / 10, done=self.left <= 0, info={"left": self.left})


def reply_length(transcript, task) -> float:
    return float(len(transcript[-1]["content"]) % 5)


def scripted(env, role, rng):
    return f"{role}-{rng.randint(0, 99)}-after-{len(env.moves())}"


class RelayEnv:
    """Three roles act in order c, a, b; the last of each round wins 1 from the first."""

    agents = ("a", "b", "c")
    order = ("c", "a", "b")

    def reset(self, rounds: int = 2):
        self.rounds, self.log = rounds, []

    def moves(self):
        return list(self.log)

    def turn(self):
        return None if len(self.log) >= self.rounds * 3 else self.order[len(self.log) % 3]

    def observation(self, agent):
        return f"you are {agent}; so far: {' | '.join(text for _, text in self.log)[-200:]}"

    def step(self, agent, action):
        from tinkerless.envs.base import MultiStepResult

        self.log.append((agent, action))
        done = len(self.log) >= self.rounds * 3
        rewards = {self.order[2]: 1.0, self.order[0]: -1.0} if len(self.log) % 3 == 0 else {}
        return MultiStepResult(rewards=rewards, done=done, info={"winner": self.order[2]} if done else {})


def episodes_equal(first, second) -> None:
    assert len(first) == len(second)
    for a, b in zip(first, second):
        assert (a.status, a.reward, a.turn_rewards, a.transcript, a.info, a.error) == (b.status, b.reward, b.turn_rewards, b.transcript, b.info, b.error)
        assert a.tokens.tolist() == b.tokens.tolist() and a.mask.tolist() == b.mask.tolist()


def test_hosted_rollouts_equal_in_process_ones(worker):
    from tinkerless.functions.hosting.user_code import tenant_scope
    from tinkerless.wire.messages import EpisodeLimits, MultiAgentRolloutRequest, RolloutRequest, SamplingParams, Seat

    single = RolloutRequest(
        policy="base", tasks=[{"start": 2}, {"start": 3}], group_size=2, env=pack_code(CountdownEnv), reward=pack_code(reply_length),
        sampling=SamplingParams(max_tokens=6, temperature=1.0), limits=EpisodeLimits(max_turns=4, max_episode_tokens=512), seed=3,
    )
    multi = MultiAgentRolloutRequest(  # a scripted seat: the opponent gets the hosted env and the caller's rng
        tasks=[{"rounds": 2}], group_size=2, env=pack_code(RelayEnv),
        seats={"a": Seat("base"), "b": Seat(opponent=pack_code(scripted), trainable=False), "c": Seat("base")},
        sampling=SamplingParams(max_tokens=5, temperature=1.0), limits=EpisodeLimits(max_turns=4, max_episode_tokens=1024),
        seed=5, protocol_timeout=60.0,
    )
    local_single, local_multi = worker.rollout(single).episodes, worker.rollout_multi(multi).episodes
    hosts = UserCodeHosts()
    worker.user_code_hosts = hosts
    try:
        with tenant_scope("carol"):
            hosted_single, hosted_multi = worker.rollout(single).episodes, worker.rollout_multi(multi).episodes
    finally:
        worker.user_code_hosts = None
        hosts.close()
    assert all(e.status == "ok" for e in local_single + local_multi)
    episodes_equal(local_single, hosted_single)
    episodes_equal(local_multi, hosted_multi)


def test_a_hosted_call_that_kills_or_hangs_its_host_fails_alone_and_the_host_comes_back():
    from tinkerless.functions.hosting.user_code import HostedCodeError, tenant_scope

    def suicide(completion, task):
        import os as _os
        import signal as _signal

        _os.kill(_os.getpid(), _signal.SIGKILL)

    def spin(completion, task):
        while True:
            pass

    def fine(completion, task):
        return 2.0

    hosts = UserCodeHosts(call_timeout=3.0)
    try:
        with tenant_scope("dave"):
            with pytest.raises(HostedCodeError, match="died"):
                hosts.load(pack_code(suicide))("x", {})
            assert hosts.load(pack_code(fine))("x", {}) == 2.0  # a fresh host
            with pytest.raises(HostedCodeError, match="did not answer within 3 s"):
                hosts.load(pack_code(spin))("x", {})
            assert hosts.load(pack_code(fine))("x", {}) == 2.0
    finally:
        hosts.close()


def test_a_shared_server_without_bubblewrap_refuses_to_start(monkeypatch):
    from tinkerless.envs.sandbox import SandboxUnavailable
    from tinkerless.server.serving import serve

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap") as caught:
        serve(model="unused-the-check-comes-first")
    assert "apt-get install bubblewrap" in caught.value.hint


def test_a_host_that_sends_half_an_answer_cannot_hold_the_server():
    """Tenant code that finds the replies pipe and writes a frame's first bytes, then stalls, is cut off at the deadline."""
    from tinkerless.functions.hosting.user_code import HostedCodeError, tenant_scope

    def half_frame(completion, task):
        import os as _os
        import sys as _sys
        import time as _time

        frame = _sys._getframe()
        while frame is not None and "replies_fd" not in frame.f_locals:
            frame = frame.f_back
        _os.write(frame.f_locals["replies_fd"], b"\x00\x00")  # 2 of a frame length's 4 bytes
        _time.sleep(60)

    hosts = UserCodeHosts(call_timeout=2.0)
    try:
        with tenant_scope("erin"):
            started = time.monotonic()
            with pytest.raises(HostedCodeError, match="did not answer within 2 s"):
                hosts.load(pack_code(half_frame))("x", {})
            assert time.monotonic() - started < 6
    finally:
        hosts.close()


def test_a_host_that_stops_reading_cannot_hold_the_server():
    """Tenant code that makes its host stop reading requests: a large request times out instead of blocking."""
    from tinkerless.functions.hosting.user_code import HostedCodeError, tenant_scope

    def stop_reading(completion, task):
        import time as _time

        import tinkerless.functions.hosting.user_code_host as host_module

        host_module.read_frame = lambda *args, **kwargs: _time.sleep(3600)  # the host's loop never reads again
        return 1.0

    hosts = UserCodeHosts(call_timeout=2.0)
    try:
        with tenant_scope("frank"):
            reward = hosts.load(pack_code(stop_reading))
            assert reward("x", {}) == 1.0
            started = time.monotonic()
            with pytest.raises(HostedCodeError, match="did not answer within 2 s"):
                reward("x" * 4_000_000, {})  # far more than a pipe holds
            assert time.monotonic() - started < 6
    finally:
        hosts.close()
