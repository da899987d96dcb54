"""Rollouts ahead of the update (`max_staleness`), readers in processes of their own, and proven version hand-offs.

The class of bug: a step that samples from "whatever is newest" (so a run depends on timing), a reader that keeps
sampling old weights after a sync with no error (SkyRL #1680, TRL #5312, prime-rl #1857), a resumed async run that
lost the older versions its in-flight steps sampled from, an update that sees rollouts of a later step.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import write_resumable_example

import tinkerless
from tinkerless.envs.gomoku import GomokuEnv
from tinkerless.errors import ConfigError, TinkerlessError
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.wire.messages import Datum, ForwardRequest, LoadStateRequest, LoraConfig, PolicyState, SamplingParams

CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]


@tinkerless.reward
def vowels(completion, task):
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


def _train(tmp_path, tiny_model, **overrides):
    settings = dict(model=tiny_model, reward=vowels, tasks=lambda rng: {"prompt": "say " + str(rng.randint(0, 99))},
                    steps=5, batch_size=2, group_size=4, max_tokens=8, temperature=1.0, learning_rate=3e-2,
                    checkpoint_every=1, keep_checkpoints=None, seed=7, storage=str(tmp_path), progress=False,
                    run_id="r", threads=1)
    settings.update(overrides)
    return tinkerless.train(**settings)


def _checkpoint_files(storage: Path, step: int, prefix: str = "adapter/") -> dict[str, bytes]:
    root = storage / "runs/r/checkpoints" / f"step-{step}"
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()
            and str(p.relative_to(root)).startswith(prefix)}


def _record_played(monkeypatch) -> dict[int, list]:
    """Each step's episodes as the pipeline plays them (step -> episodes), filled as the run goes."""
    from tinkerless.sdk.run import trainer

    played: dict[int, list] = {}
    original = trainer._Run._play

    def recording(self, step, view):
        result = original(self, step, view)
        played[step] = result[2]
        return result

    monkeypatch.setattr(trainer._Run, "_play", recording)
    return played


def _sampler_gap(worker: Worker, storage: Path, version: int, episodes: list) -> float:
    """The largest difference between the episodes' recorded sampler log-probs and checkpointed `version`'s own
    log-probs of the same tokens, over every sampled token of every sequence."""
    files = _checkpoint_files(storage, version)
    worker.load_state(LoadStateRequest(PolicyState(f"v{version}", files, version), include_optimizer=False))
    sequences = [q for e in episodes if e.status != "error" for q in e.sequences() if q.mask.sum()]
    forward = worker.forward(ForwardRequest(f"v{version}", [Datum(q.tokens, q.mask) for q in sequences]))
    return max(float(np.abs(lp[q.mask == 1] - q.sampler_logprobs[q.mask == 1]).max())
               for q, lp in zip(sequences, forward.logprobs))


def test_step_s_samples_from_exactly_version_s_minus_k(tmp_path, tiny_model, monkeypatch):
    """Each step's recorded sampler log-probs are the log-probs of the checkpointed version s − k (the adapter after
    the updates of steps before s − k), not of the newest one: the staleness is exact, never "whatever is newest"."""
    played = _record_played(monkeypatch)
    result = _train(tmp_path, tiny_model, max_staleness=2, steps=6)
    assert [r["staleness"] for r in result.metrics] == [0, 1, 2, 2, 2, 2]
    worker = Worker(tiny_model, threads=1)
    for step in (3, 4, 5):
        # the version it must sample from, and the newest one then
        scores = {version: _sampler_gap(worker, tmp_path, version, played[step]) for version in (step - 2, step)}
        assert scores[step - 2] < 1e-4, (step, scores)
        assert scores[step] > 1e-3, f"the test needs versions that differ: {scores}"


@tinkerless.env
class Echoes:
    """Three sampled turns with an observation between them (mask 0 inside the row)."""

    def reset(self, start: int) -> str:
        self.turn = start
        return f"start at {start}"

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        return tinkerless.StepResult(f"now {self.turn}", reward=sum(c in "aeiou" for c in action) / 10,
                                     done=self.turn >= 3 + self.turn % 2)


@tinkerless.agent
async def two_replies(client, task):
    """An agent function: two calls through the OpenAI client, the second one after a reply of the first."""
    first = [{"role": "user", "content": f"say {task['n']}"}]
    reply = await client.chat.completions.create(model="policy", messages=first, logprobs=True)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                      {"role": "user", "content": "again"}]
    again = await client.chat.completions.create(model="policy", messages=second, logprobs=True)
    # Vowels, plus a little for any ASCII: it varies within a group whatever the tiny model's byte soup draws.
    return sum((c in "aeiou") + 0.1 * c.isascii() for c in again.choices[0].message.content or "") / 10


def _untrained_between_turns(mask: np.ndarray) -> bool:
    trained = np.flatnonzero(mask)
    return len(trained) > 0 and bool((mask[trained[0]: trained[-1]] == 0).any())


@pytest.mark.parametrize("kind", ["env", "agent"])
def test_env_and_agent_function_steps_sample_from_exactly_version_s_minus_k(tmp_path, tiny_model, monkeypatch, kind):
    """The same exactness for a multi-turn env (observations between sampled turns) and for an agent function
    (its OpenAI calls are served by the reader of version s - k): every sampled token's recorded log-prob is that
    version's, not the newest one's."""
    played = _record_played(monkeypatch)
    kind_settings = ({"env": Echoes, "reward": None, "tasks": lambda rng: {"start": rng.randint(0, 1)}, "max_turns": 4}
                     if kind == "env" else {"agent": two_replies, "reward": None, "tasks": lambda rng: {"n": rng.randint(0, 9)}})
    result = _train(tmp_path, tiny_model, max_staleness=1, steps=4, **kind_settings)
    assert [r["staleness"] for r in result.metrics] == [0, 1, 1, 1]
    worker = Worker(tiny_model, threads=1)
    for step in (2, 3):
        sequences = [q for e in played[step] if e.status != "error" for q in e.sequences()]
        assert any(_untrained_between_turns(q.mask) for q in sequences)  # several sampled turns in one row
        scores = {version: _sampler_gap(worker, tmp_path, version, played[step]) for version in (step - 1, step)}
        assert scores[step - 1] < 1e-4, (step, scores)
        assert scores[step] > 1e-3, f"the test needs versions that differ: {scores}"


def test_an_async_run_is_the_same_for_a_seed_in_one_process_or_with_a_reader_process(tmp_path, tiny_model):
    one = _train(tmp_path / "one", tiny_model, max_staleness=1)
    two = _train(tmp_path / "two", tiny_model, max_staleness=1, rollout_workers=1, threads=2)
    assert [r["reward_mean"] for r in one.metrics] == [r["reward_mean"] for r in two.metrics]
    assert _checkpoint_files(tmp_path / "one", 5) == _checkpoint_files(tmp_path / "two", 5)
    # A checkpoint keeps the older version its next step samples from (the last one too: a resume may go on).
    for step in (4, 5):
        files = json.loads((tmp_path / f"one/runs/r/checkpoints/step-{step}/manifest.json").read_text())["files"]
        assert {"/".join(name.split("/")[:3]) for name in files if name.startswith("readers/")} == {f"readers/v{step - 1}/default"}


def test_max_staleness_zero_is_the_synchronous_loop(tmp_path, tiny_model):
    sync = _train(tmp_path / "sync", tiny_model, steps=3)
    assert [r["staleness"] for r in sync.metrics] == [0, 0, 0]
    files = json.loads((tmp_path / "sync/runs/r/checkpoints/step-3/manifest.json").read_text())["files"]
    assert not any(name.startswith("readers/") for name in files)


def test_a_killed_async_run_resumes_to_the_uninterrupted_adapter(tmp_path, tiny_model):
    example = write_resumable_example(tmp_path / "resumable.py", tiny_model, 10)

    def train(storage: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
        cmd = [*CLI, "train", str(example), "--storage", str(storage), "--run-id", "r", "--no-progress",
               "--max-staleness", "2", *extra]
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        if wait:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, out
        return proc

    def latest(storage: Path) -> int:
        try:
            return json.loads((storage / "runs/r/checkpoints/latest").read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return 0

    train(tmp_path / "straight")
    killed = tmp_path / "killed"
    proc = train(killed, wait=False)
    deadline = time.monotonic() + 300
    while latest(killed) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.25))  # anywhere inside the following steps, rollouts ahead in flight
    assert proc.poll() is None, "the run finished before it could be killed; make it longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 3 <= latest(killed) < 10
    train(killed, "--resume")
    assert _checkpoint_files(tmp_path / "straight", 10) == _checkpoint_files(killed, 10)
    steps = [json.loads(line)["step"] for line in (killed / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(10))


def test_a_resume_with_another_staleness_is_refused_before_it_trains(tmp_path, tiny_model):
    _train(tmp_path, tiny_model, max_staleness=2, steps=3)
    with pytest.raises(ConfigError, match=r"does not hold policy versions \[0\].*max_staleness=3"):
        _train(tmp_path, tiny_model, max_staleness=3, steps=5, resume=True)
    longer = _train(tmp_path, tiny_model, max_staleness=2, steps=5, resume=True)  # the same staleness goes on
    assert [r["step"] for r in longer.metrics] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [{"max_staleness": -1}, {"max_staleness": True}, {"rollout_workers": 1.5},
                                 {"rollout_workers": 2, "backend": "http://127.0.0.1:9"}])
def test_bad_settings_are_config_errors(tiny_model, bad):
    with pytest.raises(ConfigError, match="max_staleness|rollout_workers"):
        tinkerless.TrainConfig(model=tiny_model, reward=vowels, tasks=[{"prompt": "x"}], **bad).validate()


def test_multi_agent_barriers_keep_their_meaning_with_rollouts_ahead(tmp_path, tiny_model):
    agents = tinkerless.round_robin(["p", "q"], roles=("black", "white"))
    result = tinkerless.train(model=tiny_model, env=GomokuEnv, tasks=[{"size": 4, "win_length": 3, "max_invalid": 1}],
                              steps=3, batch_size=1, group_size=2, max_turns=8, max_tokens=4, temperature=1.0,
                              storage=str(tmp_path), progress=False, checkpoint_every=1, run_id="ma", agents=agents,
                              max_staleness=1)
    for step in range(3):
        events = [(e, p) for s, e, p in result.events if s == step]
        rollouts = [i for i, (e, _) in enumerate(events) if e == "rollouts_in"]
        updates = [i for i, (e, _) in enumerate(events) if e == "update_start"]
        assert sorted(p for e, p in events if e == "rollouts_in") == ["p", "q"]
        assert max(rollouts) < min(updates) and events[-1] == ("committed", "*")
    assert [r["staleness"] for r in result.metrics] == [0, 1, 1]
    assert all(f"reward_mean/{p}" in result.metrics[-1] for p in "pq")


@pytest.fixture(scope="module")
def reader_backend(tiny_model):
    backend = LocalBackend(tiny_model, rollout_workers=1, threads=2)
    yield backend
    backend.close()


def test_a_reader_syncs_to_every_writer_change_and_samples_what_the_writer_would(reader_backend, tiny_model):
    writer = TrainingClient(reader_backend, "p", LoraConfig(rank=4, seed=3), namespace="sync")
    alone = TrainingClient(LocalBackend(tiny_model, threads=1), "p", LoraConfig(rank=4, seed=3), namespace="sync")
    tokens = np.arange(5, 25, dtype=np.int32)
    ones = np.ones(len(tokens), np.float32)
    for _ in range(3):
        params = SamplingParams(max_tokens=8, temperature=1.0)
        got = writer.sample([[3, 4, 5]], n=3, params=params, seed=1).sequences
        want = alone.sample([[3, 4, 5]], n=3, params=params, seed=1).sequences
        assert [s.tokens for s in got[0]] == [s.tokens for s in want[0]]
        for client in (writer, alone):
            client.update([Datum(tokens, ones, advantages=ones, sampler_logprobs=-ones)], "importance_sampling")


def test_a_reader_refuses_files_or_weights_that_are_not_the_writers(reader_backend):
    from tinkerless.sdk.backends.reader_processes import Published

    writer = TrainingClient(reader_backend, "q", LoraConfig(rank=4, seed=4), namespace="proof")
    state = writer.save_state(include_optimizer=False)
    writer.load_state(state, include_optimizer=False)  # a published snapshot, with its proof
    name = writer.remote("q")
    change, published = reader_backend._published[name]
    torn = {k: (v[:-1] + bytes([v[-1] ^ 1]) if k.endswith(".safetensors") else v) for k, v in published.files.items()}
    reader_backend._published[name] = (change, Published(published.version, torn, published.proof))
    with pytest.raises(TinkerlessError, match=rf"policy '{name}' version \d+: its adapter files hash to"):
        writer.sample([[3, 4]], params=SamplingParams(max_tokens=2))
    proof = json.loads(published.proof)
    proof["probe_logprobs"] = [v - 0.5 for v in proof["probe_logprobs"]]  # the right files, other weights' log-probs
    reader_backend._published[name] = (change, Published(published.version, published.files,
                                                          json.dumps(proof, sort_keys=True).encode()))
    with pytest.raises(TinkerlessError, match=r"log-probs of the probe sequence differ from the writer's by 0\.5"):
        writer.sample([[3, 4]], params=SamplingParams(max_tokens=2))


class HotLoadingLLM:
    """Stands in for vLLM's `LLM` (vLLM needs a GPU and cannot be installed here): it hot-loads each LoRA
    request's adapter directory into a transformers Worker of its own, as vLLM loads it, and answers
    `prompt_logprobs` from it. `stale=True` keeps serving the first adapter it loaded: the silent failure."""

    def __init__(self, model_path: str, stale: bool = False):
        self.worker = Worker(model_path, engine="transformers", threads=1)
        self.stale, self.loaded = stale, None

    def generate(self, prompts, params, lora_request=None, use_tqdm=False):
        from types import SimpleNamespace

        if lora_request is not None and not (self.stale and self.loaded):
            files = {f"adapter/{n}": (Path(lora_request.path) / n).read_bytes() for n in os.listdir(lora_request.path)}
            self.worker.load_state(LoadStateRequest(PolicyState("served", files), include_optimizer=False))
            self.loaded = lora_request.path
        tokens = prompts[0]["prompt_token_ids"]
        row = Datum(np.asarray(tokens, np.int32), np.ones(len(tokens), np.float32))
        logprobs = self.worker.forward(ForwardRequest("served", [row])).logprobs[0]
        steps = [None] + [{t: SimpleNamespace(logprob=float(v))} for t, v in zip(tokens[1:], logprobs[1:])]
        return [SimpleNamespace(prompt_logprobs=steps)]


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """The vllm modules the engine imports, with `LLM` a HotLoadingLLM (what `stale` says)."""
    import types

    from tinkerless.functions.sampling import vllm_engine

    made = {}
    modules = {name: types.ModuleType(name) for name in ("vllm", "vllm.inputs", "vllm.lora", "vllm.lora.request")}
    modules["vllm"].LLM = lambda model, **kwargs: made.setdefault("llm", HotLoadingLLM(model, stale=made["stale"]))
    modules["vllm"].SamplingParams = dict
    modules["vllm.inputs"].TokensPrompt = dict
    modules["vllm.lora.request"].LoRARequest = lambda name, int_id, path: types.SimpleNamespace(
        lora_name=name, lora_int_id=int_id, path=path)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)
    return made


@pytest.mark.parametrize("stale", [False, True], ids=["hot-loads", "keeps-an-old-adapter"])
def test_the_vllm_engine_proves_each_adapter_version_it_hot_loads(tiny_model, stand_in_vllm, stale):
    """The first use of a policy version in vLLM runs the probe through vLLM and compares it with the worker's own
    copy: a fresh load passes (and is not proven again), an engine still serving the old weights is refused."""
    from tinkerless.functions.handoff import WeightSyncError
    from tinkerless.wire.messages import AdamParams, CreatePolicyRequest, UpdateRequest
    from tinkerless.functions.losses import LossConfig

    stand_in_vllm["stale"] = stale
    worker = Worker(tiny_model, engine="vllm", threads=1)
    worker.create_policy(CreatePolicyRequest("p", LoraConfig(rank=4, seed=3)))
    first = worker.engine._lora_request("p")
    assert first.lora_int_id == worker.engine._lora_request("p").lora_int_id == 1  # the same id, proven once
    assert list(worker.engine.probe_gaps) == ["p@0"] and worker.engine.probe_gaps["p@0"] <= 1e-3
    tokens, _ = worker._probe("p")
    probe = np.asarray(tokens, np.int32)
    ones = np.ones(len(probe), np.float32)
    for _ in range(3):  # trained on the probe itself, so its log-probs move well past the engine's tolerance
        worker.update(UpdateRequest("p", [Datum(probe, ones, advantages=ones * 5, sampler_logprobs=-ones)],
                                    LossConfig(name="importance_sampling"), AdamParams(learning_rate=0.05)))
    if not stale:
        assert worker.engine._lora_request("p").lora_int_id == 2 and worker.engine.probe_gaps["p@3"] <= 1e-3
        return
    with pytest.raises(WeightSyncError, match=r"policy 'p' version 3: after loading, the vLLM engine's log-probs"):
        worker.engine._lora_request("p")
    assert "p@3" not in worker.engine._lora_ids  # not kept: the next use checks again
    with pytest.raises(WeightSyncError):
        worker.engine._lora_request("p")


def test_on_modal_the_rollouts_of_the_next_step_run_while_the_update_runs(tiny_model, tmp_path):
    """Function.local() stands in for the containers: the call timeline shows a rollout call in flight while an
    update call runs, and the run equals the same async run on the local backend (readers load each version from
    the Volume directory, proven)."""
    import threading

    from test_modal import _config, _LocalClasses

    from tinkerless.cloud import modal_app
    from tinkerless.cloud.modal_backend import ModalBackend
    from tinkerless.cloud.modal_config import ModalConfig
    from tinkerless.sdk.run.trainer import train

    built = modal_app.build_app(ModalConfig())
    fakes = {role: _LocalClasses(built.classes[role]) for role in ("rollout", "forward", "update")}
    config = _config(tiny_model, tmp_path / "local", steps=4, max_staleness=1)
    expected = train(config, backend="local")
    backend = ModalBackend(tiny_model, fakes, ModalConfig(), state_dir=str(tmp_path / "volume"), volume="",
                           engine="auto", micro_batch_size=16)
    timeline, remote = [], backend._remote

    def timed(role, method, payload):
        started = time.perf_counter()
        try:
            return remote(role, method, payload)
        finally:
            timeline.append((role, method, started, time.perf_counter(), threading.current_thread().name))

    backend._remote = timed
    got = train(config.replace(storage=str(tmp_path / "modal")), backend=backend)
    assert [m["reward_mean"] for m in got.metrics] == [m["reward_mean"] for m in expected.metrics]
    adapter = "runs/r/checkpoints/step-4/adapter/adapter_model.safetensors"
    assert (tmp_path / "modal" / adapter).read_bytes() == (tmp_path / "local" / adapter).read_bytes()
    rollouts = [(a, b) for role, method, a, b, _ in timeline if method == "rollout"]
    updates = [(a, b) for role, method, a, b, _ in timeline if method == "update"]
    assert len(rollouts) == 4 and updates
    overlapping = [(r, u) for r in rollouts for u in updates if r[0] < u[1] and u[0] < r[1]]
    assert overlapping, f"no rollout call was in flight during an update call: {timeline}"


def test_through_a_server_an_async_run_and_its_resume_equal_the_local_one(tiny_model, tmp_path):
    """On `tinkerless serve` the readers are the server's policies and the older versions sit in the server's
    checkpoints: a run stopped after step 3 and resumed there ends as the local async run does."""
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running
    from tinkerless.storage import CheckpointStore, ObjectStore

    local = _train(tmp_path / "local", tiny_model, max_staleness=2)
    server = tmp_path / "server"
    with running(create_app(Worker(tiny_model, threads=1), storage=str(server))) as url:
        _train(tmp_path / "client", tiny_model, max_staleness=2, steps=3, backend=HTTPBackend(url))
        resumed = _train(tmp_path / "client", tiny_model, max_staleness=2, resume=True, backend=HTTPBackend(url))
    assert [r["reward_mean"] for r in resumed.metrics] == [r["reward_mean"] for r in local.metrics]
    ours = CheckpointStore(ObjectStore(str(server / "tenants/_")), "runs/r/checkpoints").load(5).files
    theirs = CheckpointStore(ObjectStore(str(tmp_path / "local")), "runs/r/checkpoints").load(5).files
    assert ours["adapter/adapter_model.safetensors"] == theirs["adapter/adapter_model.safetensors"]
    assert {k for k in ours if k.startswith("readers/")} == {k for k in theirs if k.startswith("readers/")} != set()
