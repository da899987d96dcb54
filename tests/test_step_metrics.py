"""Every second of a step accounted for: the env's own time apart from generation, encode/decode time,
prefill/decode token counts from the rollout, and the time a call queued on a server."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

import tinkerless
from tinkerless.envs.base import StepResult
from tinkerless.functions.rollout.rollout_clock import measure, rollout_clock
from tinkerless.sdk.backends.base import LocalBackend, call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.run.metrics import read_metrics
from tinkerless.sdk.run.step_metrics import ROLLOUT_COLUMNS, step_record
from tinkerless.server import create_app, serve_in_thread
from tinkerless.wire.http import QUEUE_SECONDS_HEADER
from tinkerless.wire.messages import (
    BASE_POLICY,
    EpisodeLimits,
    Episode,
    RolloutRequest,
    SampleRequest,
    SamplingParams,
)
from tinkerless.wire import pack_code

ENV_SECONDS = 0.05  # each reset and step of the env below


class SlowEcho:
    """Three turns; the env's own code sleeps, so its time is known from below."""

    def reset(self, **task):
        time.sleep(ENV_SECONDS)
        self.turns = 0
        return "say something"

    def step(self, action: str) -> StepResult:
        time.sleep(ENV_SECONDS)
        self.turns += 1
        return StepResult(observation=f"turn {self.turns}", reward=0.1, done=self.turns >= 3)


def test_parts_nest_exclusively_and_measure_nothing_outside_a_clock():
    with measure("env"):  # no clock open: nothing to record, nothing raised
        pass
    with rollout_clock() as clock:
        with measure("env"):
            time.sleep(0.02)
            with measure("encode"):
                time.sleep(0.03)
            time.sleep(0.02)
        with measure("decode"):
            pass
    stats = clock.as_stats()
    assert set(stats) == {"generate_s", "env_s", "encode_s", "decode_s"}
    assert 0.03 <= stats["encode_s"] < 0.03 + 0.05
    assert 0.04 <= stats["env_s"] < 0.04 + 0.05  # the inner encode is not counted twice
    assert stats["generate_s"] == 0.0


def test_a_clock_is_per_thread():
    seen = {}

    def other():
        with measure("env"):
            time.sleep(0.02)
        seen["done"] = True

    with rollout_clock() as clock:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert seen["done"] and clock.as_stats()["env_s"] == 0.0


def test_a_multi_turn_rollout_reports_env_generate_encode_and_decode_seconds(worker):
    request = RolloutRequest(
        policy=BASE_POLICY, tasks=[{}, {}], group_size=2, sampling=SamplingParams(max_tokens=6, temperature=1.0),
        limits=EpisodeLimits(max_turns=3), seed=3, env=pack_code(SlowEcho),
    )  # fmt: skip
    result = worker.rollout(request)
    stats = result.stats
    assert all(e.status != "error" for e in result.episodes), [e.error for e in result.episodes]
    envs = len(result.episodes)
    calls = envs + sum(e.num_turns for e in result.episodes)  # every reset and every step slept
    assert stats["env_s"] >= calls * ENV_SECONDS * 0.95
    assert stats["generate_s"] > 0 and stats["encode_s"] > 0 and stats["decode_s"] > 0
    parts = sum(stats[f"{p}_s"] for p in ("generate", "env", "encode", "decode"))
    assert parts <= stats["seconds"] + 1e-6


def _episode(tokens: int = 5) -> Episode:
    mask = np.array([0, 0, 1, 1, 1], dtype=np.float32)[:tokens]
    return Episode(0, np.arange(tokens, dtype=np.int32), mask, np.zeros(tokens, np.float32), 2, reward=0.5,
                   transcript=[{"role": "assistant", "content": "x"}])  # fmt: skip


def test_step_record_takes_the_rollout_columns_it_gets_and_only_finite_numbers():
    timings = {"rollout_s": 2.0, "forward_s": 0.0, "update_s": 1.0, "storage_s": 0.0}
    stats = {"prefill_tokens": 120.0, "cached_prompt_tokens": 80, "decoded_tokens": 24.0, "generate_s": 1.5,
             "env_s": 0.25, "encode_s": 0.01, "decode_s": math.nan, "seconds": 2.0, "other": 7.0}  # fmt: skip
    record = step_record(0, [_episode()], {"default": {"loss": 0.1}}, timings, {"default": 1}, 3.0, stats)
    for key in ("prefill_tokens", "cached_prompt_tokens", "decoded_tokens", "generate_s", "env_s", "encode_s"):
        assert record[key] == float(stats[key])
    assert "decode_s" not in record and "other" not in record
    assert record["tokens_per_s"] == pytest.approx(3 / 2.0)  # the progress bar's figure stays
    plain = step_record(0, [_episode()], {"default": {"loss": 0.1}}, timings, {"default": 1}, 3.0)
    assert not set(ROLLOUT_COLUMNS) & set(plain)


@tinkerless.reward
def length_reward(completion, task):
    return float(len(completion) % 5) / 5


def test_a_run_logs_where_each_step_went(tiny_model, tmp_path):
    result = tinkerless.train(
        model=tiny_model, env=SlowEcho, tasks=[{}], steps=1, batch_size=1, group_size=2, max_tokens=4,
        max_turns=2, seed=0, progress=False, storage=str(tmp_path), run_id="where", backend=LocalBackend(tiny_model),
    )  # fmt: skip
    (record,) = read_metrics(result.run_dir / "metrics.jsonl")
    assert record["env_s"] >= 2 * ENV_SECONDS  # two resets at least
    assert record["generate_s"] > 0 and record["encode_s"] > 0 and record["decode_s"] > 0
    assert record["generate_s"] + record["env_s"] <= record["rollout_s"]
    assert record["queue_s"] == 0.0  # in-process: nothing queues
    assert record["tokens_per_s"] > 0


def test_the_server_says_how_long_a_call_queued_and_the_client_records_it(tiny_model):
    from tinkerless.functions.worker import Worker

    queued: list[float] = []
    app = create_app(Worker(tiny_model), slice_seconds=60.0)
    with serve_in_thread(app) as url:
        first, second = HTTPBackend(url, timeout=120), HTTPBackend(url, timeout=120)
        second._client.event_hooks["response"].append(
            lambda r: queued.append(float(r.headers[QUEUE_SECONDS_HEADER])) if QUEUE_SECONDS_HEADER in r.headers else None
        )
        long = SampleRequest(BASE_POLICY, [[1, 2, 3]] * 4, 1, SamplingParams(max_tokens=800, stop_token_ids=[]))
        thread = threading.Thread(target=lambda: call(first, "sample", long))
        thread.start()
        deadline = time.monotonic() + 60
        while app.state.scheduler.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # until the long call holds the model (no slicing within 60 s)
        started = time.perf_counter()
        call(second, "sample", SampleRequest(BASE_POLICY, [[1, 2]], 1, SamplingParams(max_tokens=2)))
        waited = time.perf_counter() - started
        thread.join()
    assert len(queued) == 1
    assert 0 < queued[0] <= waited
    assert second.usage.queue_seconds() == pytest.approx(queued[0])
    assert first.usage.queue_seconds() >= 0.0
