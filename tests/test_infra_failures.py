"""Episodes that failed for an infrastructure reason (an env server that dropped them, a judge that timed out, a
dead sandbox) are played again, then dropped from their groups and counted, never scored (docs/errors.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

import tinkerless
from tinkerless.errors import ConfigError, EnvError, InfrastructureFailure, RemoteError, infra_cause
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.run import infra_failures
from tinkerless.sdk.run.advantages import AdvantageConfig, group_advantages
from tinkerless.sdk.run.batches import datums
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import Episode, ErrorReply
from tinkerless.wire.replies import error_reply, raise_error_reply


class _EnvServer:
    """A real env server on 127.0.0.1: `/reset` starts an episode, `/step` scores a turn. Every `drop_every`-th
    reset (counted over the server's life) is dropped: the connection closes without an answer."""

    def __init__(self, drop_every: int):
        self.drop_every, self.resets, self.dropped, self.lock = drop_every, 0, 0, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
                if self.path == "/reset":
                    with server.lock:
                        number, server.resets = server.resets, server.resets + 1
                        drop = number % server.drop_every == server.drop_every - 1
                        server.dropped += drop
                    if drop:  # a dropped episode: no answer at all
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    answer = {"observation": f"count the letters of {body['word']}"}
                else:  # /step: 1 for a non-empty answer, more for a longer one (never 0: a 0 would look like a drop)
                    answer = {"reward": 0.5 + min(len(body["action"]), 8) / 16}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    @contextmanager
    def serving(self):
        thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.http.shutdown()
            self.http.server_close()


@tinkerless.env
class RemoteWords:
    """The user's env: a client of the env server. A server that does not answer is an infrastructure failure."""

    def reset(self, server: str, word: str) -> str:
        self.server = server
        return self._post("/reset", {"word": word})["observation"]

    def step(self, action: str) -> tinkerless.StepResult:
        return tinkerless.StepResult(observation=None, reward=self._post("/step", {"action": action})["reward"], done=True)

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = httpx.post(self.server + path, json=body, timeout=10)
        except httpx.TransportError as exc:
            raise InfrastructureFailure(f"the env server dropped the episode ({exc})", cause="env_server_unreachable") from exc
        return response.json()


WORDS = ["apple", "river", "stone", "cloud"]


def _train(tiny_model: str, storage: Path, server: _EnvServer, **overrides):
    settings = dict(
        model=tiny_model, env=RemoteWords, tasks=[{"server": server.url, "word": w} for w in WORDS], steps=2,
        batch_size=4, group_size=5, max_turns=1, max_tokens=4, temperature=1.0, storage=str(storage), progress=False,
        run_id="infra", transcripts_per_step=20, seed=3,
    )
    settings.update(overrides)
    return tinkerless.train(**settings)


def _episodes(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "episodes.jsonl").read_text().splitlines()]


def _check_dropped_not_scored(result, dropped_per_step: int) -> None:
    records = _episodes(result.run_dir)
    for metrics in result.metrics:
        step = metrics["step"]
        played = [r for r in records if r["step"] == step]
        dropped = [r for r in played if r["status"] == "infra_failed"]
        kept = [r for r in played if r["status"] != "infra_failed"]
        assert len(dropped) == dropped_per_step == metrics["episodes_infra_failed"]
        assert len(kept) + len(dropped) == 20 and metrics["episodes"] == len(kept) and metrics["episodes_error"] == 0
        for record in dropped:  # its cause recorded, and no reward at all (never a 0)
            assert record["infra_cause"] == "env_server_unreachable" and "dropped the episode" in record["error"]
            assert record["reward"] is None or math.isnan(record["reward"])
        rewards = [r["reward"] for r in kept]
        assert min(rewards) >= 0.5  # every scored episode earned at least 0.5: a 0 could only be a dropped one
        assert metrics["reward_mean"] == pytest.approx(float(np.mean(rewards)))
        # The groups' advantages are over the episodes left: exactly those with a non-zero one were trained.
        advantages = group_advantages(rewards, [r["task_index"] for r in kept], AdvantageConfig())
        assert metrics["trained_sequences"] == sum(a != 0.0 for a in advantages)


def test_an_env_server_that_drops_a_fifth_of_its_episodes_without_retries(tiny_model, tmp_path, capsys):
    with _EnvServer(drop_every=5).serving() as server:
        result = _train(tiny_model, tmp_path, server, infra_retries=0)
    assert server.dropped == 8 and [m["episodes_infra_retried"] for m in result.metrics] == [0, 0]
    _check_dropped_not_scored(result, dropped_per_step=4)
    assert "4 episodes dropped after 0 retries (infrastructure: env_server_unreachable)" in capsys.readouterr().err


def test_dropped_episodes_are_played_again_through_a_server(tiny_model, worker, tmp_path):
    # Step 0: resets 0-19 lose 4, replayed by resets 20-23. Step 1: resets 24-43 lose 4 (24, 29, ...); their
    # replay (44-47) loses 44 again, and the second replay (48) brings it back: every episode is recovered.
    with _EnvServer(drop_every=5).serving() as server, running(create_app(worker, storage=str(tmp_path / "srv"))) as url:
        result = _train(tiny_model, tmp_path / "client", server, backend=HTTPBackend(url), infra_retries=2)
    assert server.dropped == 9 and server.resets == 49
    assert [m["episodes_infra_retried"] for m in result.metrics] == [4, 5]
    _check_dropped_not_scored(result, dropped_per_step=0)


def test_an_episode_that_fails_every_time_is_dropped_after_its_retries(tiny_model, tmp_path):
    # Every other reset is dropped: the replays lose half again, and what is left after 2 retries is dropped.
    with _EnvServer(drop_every=2).serving() as server:
        result = _train(tiny_model, tmp_path, server, infra_retries=2, steps=1)
    # 20 resets lose 10; 10 replays lose 5; 5 replays lose 2 or 3 (the count runs on): 2 or 3 left dropped.
    metrics = result.metrics[0]
    assert metrics["episodes_infra_retried"] == 15 and server.resets == 35
    _check_dropped_not_scored(result, dropped_per_step=metrics["episodes_infra_failed"])
    assert metrics["episodes_infra_failed"] in (2, 3)


def test_a_step_whose_every_episode_failed_stops_the_run_resumably(tiny_model, tmp_path):
    with _EnvServer(drop_every=1).serving() as server:
        with pytest.raises(InfrastructureFailure) as caught:
            _train(tiny_model, tmp_path, server, infra_retries=1, steps=1)
    assert caught.value.cause == "env_server_unreachable" and "all 20 episodes of step 0" in caught.value.message
    assert "resume" in caught.value.hint and server.resets == 40


def test_the_users_own_env_errors_keep_their_behaviour(tiny_model, tmp_path):
    @tinkerless.env
    class Broken:
        def reset(self, word: str) -> str:
            raise ValueError(f"no such word {word}")

        def step(self, action: str):
            raise AssertionError("never reached")

    with pytest.raises(EnvError, match="no such word"):  # not retried, not called infrastructure
        tinkerless.train(model=tiny_model, env=Broken, tasks=[{"word": "a"}], steps=1, batch_size=1, group_size=2,
                         max_tokens=2, storage=str(tmp_path), progress=False, on_env_error="raise", infra_retries=3)


def _episode(task: int, reward: float, status: str = "ok", cause: str | None = None) -> Episode:
    return Episode(task_index=task, tokens=np.arange(6, dtype=np.int32), mask=np.array([0, 0, 0, 1, 1, 1], np.float32),
                   sampler_logprobs=np.full(6, -0.5, np.float32), prompt_length=3,
                   reward=math.nan if status != "ok" else reward, status=status, infra_cause=cause)


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4], [1.0, 1.0]])
def test_a_groups_advantages_are_computed_over_the_episodes_left(rewards):
    failed = _episode(0, 0.0, "infra_failed", "judge_timeout")
    played = [_episode(0, r) for r in rewards[:1]] + [failed] + [_episode(0, r) for r in rewards[1:]]
    kept, dropped = infra_failures.split(played)
    assert dropped == [failed] and len(kept) == len(rewards)
    trained = datums(kept, AdvantageConfig())
    expected = [a for a in group_advantages(rewards, [0] * len(rewards)) if a != 0.0]
    assert [float(d.advantages.max() or d.advantages.min()) for d in trained] == pytest.approx(expected)


def test_infrastructure_failures_cross_the_wire_with_their_cause():
    try:
        raise InfrastructureFailure("the judge timed out after 30 s", cause="judge_timeout", hint="retry")
    except InfrastructureFailure as exc:
        reply = error_reply(exc)
    assert reply.cause == "judge_timeout" and reply.category == "server"
    with pytest.raises(InfrastructureFailure) as caught:
        raise_error_reply(decode_message(encode_message(reply)), where="rollout")
    assert caught.value.cause == "judge_timeout" and caught.value.hint == "retry"
    # A subclass only the remote side defines still arrives as an infrastructure failure, with its cause.
    foreign = ErrorReply(error="sandbox gone", category="server", type="SandboxVanished", cause="sandbox_died")
    with pytest.raises(RemoteError) as caught:
        raise_error_reply(foreign, where="rollout")
    assert infra_cause(caught.value) == "sandbox_died"


@pytest.mark.parametrize("cause, tag", [("judge timeout", "judge_timeout"), ("", "unknown"), (None, "unknown"),
                                         ("x" * 200, "x" * 64), ("a\nb\x00c", "a_b_c"), (7, "unknown")])
def test_a_cause_is_always_a_short_printable_tag(cause, tag):
    assert InfrastructureFailure("m", cause=cause).cause == tag


def test_an_infrastructure_failure_of_a_call_is_a_503_that_the_http_client_raises_as_one():
    class FlakyWorker:  # a function host whose env service is down for every call
        def handle(self, method: str, payload: bytes) -> bytes:
            try:
                raise InfrastructureFailure("the env server is unreachable", cause="env_server_unreachable")
            except InfrastructureFailure as exc:
                return encode_message(error_reply(exc))

        def info(self, _request=None) -> dict:
            return {}

    with running(create_app(FlakyWorker())) as url:
        raw = httpx.post(f"{url}/v1/call/rollout", content=encode_message({}), headers={"Content-Type": "application/msgpack"})
        backend = HTTPBackend(url)
        try:
            with pytest.raises(InfrastructureFailure) as caught:
                call(backend, "rollout", {})
        finally:
            backend.close()
    assert raw.status_code == 503 and decode_message(raw.content).cause == "env_server_unreachable"
    assert caught.value.cause == "env_server_unreachable"


@pytest.mark.parametrize("bad", [-1, 11, 1.5, True, "2", None])
def test_infra_retries_is_validated(tiny_model, tmp_path, bad):
    with pytest.raises(ConfigError, match="infra_retries"):
        tinkerless.train(model=tiny_model, reward=lambda c, t: 1.0, tasks=[{"prompt": "hi"}], steps=1,
                         storage=str(tmp_path), progress=False, infra_retries=bad)


def _judge(completion, task):
    """A reward whose judge is down for the tasks marked so, and whose sandbox dies on the tasks marked so."""
    if task.get("judge_down"):
        from tinkerless.errors import InfrastructureFailure as Down

        raise Down("the judge timed out after 30 s", cause="judge_timeout")
    if task.get("die"):
        import os as _os
        import signal as _signal

        _os.kill(_os.getpid(), _signal.SIGKILL)
    if task.get("bug"):
        raise ZeroDivisionError("the user's own reward has a bug")
    return 1.0


def test_infrastructure_failures_in_a_tenants_sandbox_keep_their_cause(worker):
    from tinkerless.functions.hosting.user_code import UserCodeHosts, tenant_scope
    from tinkerless.wire import pack_code
    from tinkerless.wire.messages import EpisodeLimits, RolloutRequest, SamplingParams

    tasks = [{"prompt": "a"}, {"prompt": "b", "judge_down": True}, {"prompt": "c", "bug": True}, {"prompt": "d", "die": True}]
    request = RolloutRequest(policy="base", tasks=tasks, group_size=1, reward=pack_code(_judge), seed=1,
                             sampling=SamplingParams(max_tokens=3, temperature=1.0),
                             limits=EpisodeLimits(max_turns=1, max_episode_tokens=256))
    hosts = UserCodeHosts()
    worker.user_code_hosts = hosts
    try:
        with tenant_scope("erin"):
            # Rewards are scored one round trip per batch: a host that dies takes the batch with it, so the
            # tasks are scored one call each here to see each outcome alone.
            episodes = [worker.rollout(dataclasses.replace(request, tasks=[task])).episodes[0] for task in tasks]
    finally:
        worker.user_code_hosts = None
        hosts.close()
    assert [e.status for e in episodes] == ["ok", "infra_failed", "error", "infra_failed"]
    assert [e.infra_cause for e in episodes] == [None, "judge_timeout", None, "sandbox_died"]
    assert episodes[0].reward == 1.0 and all(math.isnan(e.reward) for e in episodes[1:])
