"""ObjectStore and CheckpointStore on a real S3 HTTP API (moto server on 127.0.0.1),
with the same conditional-write and commit semantics checked on a local directory and memory://."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import uuid
import warnings

import pytest
from s3_server import TEST_ENV, MotoS3

import tinkerless
from tinkerless.coordinator import Coordinator, Phase, list_runs
from tinkerless.errors import CorruptCheckpoint, StorageNotFound, UserError
from tinkerless.storage import (
    CheckpointStore,
    CommitConflict,
    ObjectStore,
    PreconditionFailed,
    StorageConfigError,
)

KINDS = ["local", "memory", "s3"]
MB = 1 << 20


@pytest.fixture(scope="module")
def moto():
    server = MotoS3().start()
    yield server
    server.stop()


@pytest.fixture()
def s3_env(moto, monkeypatch, tmp_path):
    """moto's test credentials and endpoint in the standard AWS variables, nothing from ~/.aws."""
    for name, value in TEST_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    return moto


@pytest.fixture()
def bucket(s3_env) -> str:
    return s3_env.create_bucket()


def make_store(kind: str, request, tmp_path) -> ObjectStore:
    if kind == "local":
        return ObjectStore(str(tmp_path / "store"))
    if kind == "memory":
        return ObjectStore(f"memory://tl-{uuid.uuid4().hex[:8]}")
    return ObjectStore(f"s3://{request.getfixturevalue('bucket')}/root")


@pytest.fixture(params=KINDS)
def store(request, tmp_path) -> ObjectStore:
    return make_store(request.param, request, tmp_path)


def adapter_bytes(seed: int, size: int = 2 * MB) -> bytes:
    """Incompressible, reproducible bytes standing in for a LoRA adapter."""
    return random.Random(seed).randbytes(size)


# -- ObjectStore on S3 ---------------------------------------------------------------


def test_round_trip_on_s3(s3_env, bucket):
    store = ObjectStore(f"s3://{bucket}/root")
    assert store.url == f"s3://{bucket}/root" and store.local_path("a") is None
    adapter = os.urandom(4 * MB)  # a realistic LoRA adapter size
    store.put("runs/r/adapter.safetensors", adapter)
    store.put("runs/r/state.json", b"{}")
    store.put("other", b"x")
    assert store.get("runs/r/adapter.safetensors") == adapter
    assert store.exists("runs/r/state.json") and not store.exists("runs/r") and not store.exists("nope")
    assert store.list() == ["other", "runs/r/adapter.safetensors", "runs/r/state.json"]
    assert store.list("runs/r/") == ["runs/r/adapter.safetensors", "runs/r/state.json"]
    assert store.list("runs/r/state.json") == ["runs/r/state.json"]
    assert store.list("missing") == []
    with pytest.raises(StorageNotFound, match=f"s3://{bucket}/root/nope/x"):
        store.get("nope/x")
    with pytest.raises(UserError):
        store.put("../escape", b"x")

    store.delete("runs")
    assert store.list() == ["other"]
    store.delete("other")
    store.delete("does/not/exist")
    assert store.list() == []
    # Nothing was written outside the store's root.
    assert s3_env.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", None])
def test_endpoint_from_env_or_storage_options(moto, s3_env, monkeypatch, variable):
    """s3fs and the boto3 client for conditional writes reach the same endpoint, however it is given."""
    name = moto.create_bucket()
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options: dict = {"skip_instance_cache": True}
    if variable:
        monkeypatch.setenv(variable, moto.endpoint)
    else:
        options["client_kwargs"] = {"endpoint_url": moto.endpoint}
    store = ObjectStore(f"s3://{name}/p", **options)
    store.put("plain", b"1")
    version = store.put_if("cas", b"2", match=None)
    assert store.get("cas") == b"2" and store.get_with_version("cas") == (b"2", version)
    assert store.list() == ["cas", "plain"]


def test_missing_bucket_is_a_clear_error(s3_env):
    store = ObjectStore("s3://no-such-bucket-tl/p")
    for op in (lambda: store.get("k"), lambda: store.list(), lambda: store.put("k", b"1"), lambda: store.exists("k")):
        with pytest.raises(StorageConfigError) as info:
            op()
        assert "no-such-bucket-tl" in info.value.message and "does not exist" in info.value.message
        assert "aws s3 mb s3://no-such-bucket-tl" in info.value.hint
        assert info.value.category == "user"


def test_missing_credentials_is_a_clear_error(s3_env, monkeypatch):
    name = s3_env.create_bucket()
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    store = ObjectStore(f"s3://{name}/p", skip_instance_cache=True)
    with pytest.raises(StorageConfigError, match="no usable AWS credentials") as info:
        store.put("k", b"1")
    assert "AWS_ACCESS_KEY_ID" in info.value.hint and "AWS_PROFILE" in info.value.hint


# -- conditional writes, on every backend ----------------------------------------------


def test_conditional_writes(store):
    created = store.put_if("ptr", b"v1", match=None)
    assert store.get_with_version("ptr") == (b"v1", created)
    with pytest.raises(PreconditionFailed, match="expected not to exist"):
        store.put_if("ptr", b"again", match=None)

    updated = store.put_if("ptr", b"v2", match=created)
    assert updated != created and store.get_with_version("ptr") == (b"v2", updated)
    with pytest.raises(PreconditionFailed):
        store.put_if("ptr", b"stale", match=created)  # a writer that read v1 loses
    assert store.get("ptr") == b"v2"

    with pytest.raises(PreconditionFailed):
        store.put_if("absent", b"x", match=updated)  # If-Match on a missing object
    assert not store.exists("absent")
    with pytest.raises(StorageNotFound):
        store.get_with_version("absent")
    assert store.list() == ["ptr"]  # no lock or temp files show up


def cas_increment(store: ObjectStore, key: str) -> int:
    """Add one to a counter by read + compare-and-swap, retrying when another writer wins."""
    retries = 0
    while True:
        try:
            data, version = store.get_with_version(key)
        except StorageNotFound:
            data, version = b"0", None
        try:
            store.put_if(key, str(int(data) + 1).encode(), match=version)
            return retries
        except PreconditionFailed:
            retries += 1


def test_concurrent_compare_and_swap_loses_no_update(store):
    threads, per_thread = 4, 8
    barrier = threading.Barrier(threads)
    retries: list[int] = []

    def work():
        barrier.wait()
        retries.extend(cas_increment(store, "counter") for _ in range(per_thread))

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert int(store.get("counter")) == threads * per_thread


def test_local_compare_and_swap_across_processes(tmp_path):
    """The fcntl lock excludes other processes, not only other threads."""
    script = textwrap.dedent(
        f"""
        from tinkerless.storage import ObjectStore, PreconditionFailed
        store = ObjectStore({str(tmp_path)!r})
        done = 0
        while done < 15:
            try:
                data, version = store.get_with_version("counter")
            except Exception:  # StorageNotFound: the first increment
                data, version = b"0", None
            try:
                store.put_if("counter", str(int(data) + 1).encode(), match=version)
                done += 1
            except PreconditionFailed:
                pass
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script]) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert ObjectStore(str(tmp_path)).get("counter") == b"45"


# -- CheckpointStore -------------------------------------------------------------------

PREFIX = "runs/r1/checkpoints"


def ckpt_files(seed: int, size: int = 2 * MB) -> dict[str, bytes]:
    return {
        "adapter/adapter_model.safetensors": adapter_bytes(seed, size),
        "adapter/adapter_config.json": json.dumps({"r": 8, "seed": seed}).encode(),
        "client.json": json.dumps({"step": seed}).encode(),
    }


def test_checkpoint_round_trip_and_keep_last_on_s3(s3_env, bucket, tmp_path):
    store = ObjectStore(f"s3://{bucket}/root")
    ckpts = CheckpointStore(store, PREFIX, keep_last=2)
    assert ckpts.load_latest() is None and ckpts.steps() == []
    saved = {step: ckpt_files(step) for step in range(1, 5)}
    for step, files in saved.items():
        assert ckpts.save(step, files, {"loss": step / 10}) == f"{PREFIX}/step-{step}"
        assert ckpts.load(step).files == files

    assert ckpts.steps() == [3, 4] and ckpts.latest_step() == 4
    latest = ckpts.load_latest()
    assert latest is not None and latest.step == 4 and latest.files == saved[4] and latest.metadata == {"loss": 0.4}
    # What is left in the bucket: the two kept steps and the pointer, nothing else.
    keys = [o["Key"] for o in s3_env.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert sorted({k.split("/")[4] for k in keys}) == ["latest", "step-3", "step-4"]

    fresh = CheckpointStore(ObjectStore(f"s3://{bucket}/root"), PREFIX)  # another process's view
    assert fresh.load(3).files == saved[3]
    out = fresh.materialize(4, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter/adapter/adapter_model.safetensors").read_bytes() == saved[4]["adapter/adapter_model.safetensors"]
    assert out == str(tmp_path / "adapter")


def pause_before_commit(monkeypatch, wait) -> None:
    """Make every save call `wait(ckpts)` after its upload, right before it moves `latest`."""
    real_commit = CheckpointStore._commit

    def commit(self, *args, **kwargs):
        wait(self)
        return real_commit(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointStore, "_commit", commit)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first_step", [None, 1])
def test_racing_writers_exactly_one_commits(kind, first_step, request, tmp_path, monkeypatch):
    store = make_store(kind, request, tmp_path)
    if first_step:
        CheckpointStore(store, PREFIX, writer="earlier").save(first_step, ckpt_files(0, 4096))
    writers = {name: CheckpointStore(store, PREFIX, writer=name) for name in ("writer-a", "writer-b")}
    files = {name: ckpt_files(i + 10, 64 * 1024) for i, name in enumerate(writers)}
    # Both read `latest` and upload their step-2 files before either tries to commit.
    barrier = threading.Barrier(2, timeout=60)
    pause_before_commit(monkeypatch, lambda _: barrier.wait())
    outcome: dict[str, object] = {}

    def save(name):
        try:
            outcome[name] = writers[name].save(2, files[name])
        except CommitConflict as e:
            outcome[name] = e

    threads = [threading.Thread(target=save, args=(name,)) for name in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    winners = [n for n, o in outcome.items() if isinstance(o, str)]
    losers = [n for n, o in outcome.items() if isinstance(o, CommitConflict)]
    assert len(winners) == 1 and len(losers) == 1, outcome
    (winner,), (loser,) = winners, losers
    error = outcome[loser]
    assert "step 2" in error.message and repr(winner) in error.message and repr(loser) in error.message
    assert error.hint and error.category == "user"

    pointer = json.loads(store.get(f"{PREFIX}/latest"))
    assert pointer["step"] == 2 and pointer["writer"] == winner
    assert f"{PREFIX}/{pointer['dir']}" == outcome[winner]
    reader = CheckpointStore(store, PREFIX)
    latest = reader.load_latest()
    assert latest is not None and latest.step == 2 and latest.files == files[winner]
    assert reader.steps() == ([1, 2] if first_step else [2])
    # The loser's files are gone: only the winner's directory holds step 2.
    step2_dirs = {k.split("/")[3] for k in store.list(PREFIX) if k.split("/")[3].startswith("step-2")}
    assert step2_dirs == {pointer["dir"]}


@pytest.mark.parametrize("kind", KINDS)
def test_stale_writer_loses_without_touching_the_winner(kind, request, tmp_path, monkeypatch):
    """A writer stalled before its commit (a slow upload, a pause) while another wrote two steps."""
    store = make_store(kind, request, tmp_path)
    slow, fast = CheckpointStore(store, PREFIX, writer="slow"), CheckpointStore(store, PREFIX, writer="fast")
    fast.save(1, ckpt_files(1, 4096))
    stalled, resume = threading.Event(), threading.Event()
    pause_before_commit(monkeypatch, lambda c: (stalled.set(), resume.wait(60)) if c is slow else None)
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(_save_or_error(slow, 2, ckpt_files(99, 4096))))
    thread.start()
    assert stalled.wait(60)  # slow has claimed step-2 and uploaded into it
    fast.save(2, ckpt_files(2, 4096))  # step-2 is taken, so fast writes its own directory
    fast.save(3, ckpt_files(3, 4096))
    resume.set()
    thread.join()

    (error,) = result
    assert isinstance(error, CommitConflict)
    assert "'fast'" in error.message and "names step 3" in error.message and "'slow'" in error.message
    reader = CheckpointStore(store, PREFIX)
    assert reader.steps() == [1, 2, 3]
    assert reader.load(2).files == ckpt_files(2, 4096) and reader.load_latest().files == ckpt_files(3, 4096)
    assert store.list(f"{PREFIX}/step-2") == []  # slow removed its own directory, and only that


def _save_or_error(ckpts: CheckpointStore, step: int, files: dict) -> object:
    try:
        return ckpts.save(step, files)
    except CommitConflict as e:
        return e


CRASHING_SAVE = """
import os, sys
from tinkerless.storage import CheckpointStore, ObjectStore

ckpts = CheckpointStore(ObjectStore(sys.argv[1]), sys.argv[2], writer="crashing")
ckpts.save(1, {"w": b"one"})
# Die after step 2's files and manifest are uploaded, before `latest` moves.
CheckpointStore._commit = lambda *args, **kwargs: os._exit(17)
ckpts.save(2, {"w": b"two"})
"""


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_crash_between_upload_and_commit(kind, request, tmp_path):
    store = make_store(kind, request, tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVE, store.url, PREFIX], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 17, proc.stderr
    # The orphan is complete (files and manifest are there) but was never committed.
    assert store.list(f"{PREFIX}/step-2") == [f"{PREFIX}/step-2/{n}" for n in ("claim.json", "manifest.json", "w")]

    reader = CheckpointStore(ObjectStore(store.url), PREFIX)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # ignoring the orphan is normal, not worth a warning
        latest = reader.load_latest()
    assert latest is not None and latest.step == 1 and latest.files == {"w": b"one"}
    assert reader.steps() == [1] and reader.latest_step() == 1
    with pytest.raises(CorruptCheckpoint, match="never committed"):
        reader.load(2)  # complete and verifiable, but not committed: asking for it by number is refused too

    # The restarted run redoes step 2; it gets a directory of its own, and the orphan is pruned a step later.
    where = reader.save(2, {"w": b"two again"})
    assert where != f"{PREFIX}/step-2" and reader.load_latest().files == {"w": b"two again"}
    reader.save(3, {"w": b"three"})
    assert store.list(f"{PREFIX}/step-2") == [] and reader.steps() == [1, 2, 3]
    assert reader.load(2).files == {"w": b"two again"}


def test_corrupt_object_on_s3_is_detected_and_skipped(s3_env, bucket):
    ckpts = CheckpointStore(ObjectStore(f"s3://{bucket}/root"), PREFIX)
    ckpts.save(1, ckpt_files(1))
    ckpts.save(2, ckpt_files(2))
    key = f"root/{PREFIX}/step-2/adapter/adapter_model.safetensors"
    client = s3_env.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped bit pattern: only the checksum can tell
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    with pytest.raises(CorruptCheckpoint, match="adapter/adapter_model.safetensors") as info:
        ckpts.load(2)
    assert "step 2" in info.value.message and f"s3://{bucket}/root/{PREFIX}/step-2" in info.value.message
    with pytest.warns(RuntimeWarning, match="skipped checkpoint step 2") as caught:
        latest = ckpts.load_latest()
    assert any("adapter/adapter_model.safetensors" in str(w.message) for w in caught)
    assert latest is not None and latest.step == 1 and latest.files == ckpt_files(1)


@pytest.mark.parametrize("kind", KINDS)
def test_reader_racing_with_pruning_rereads_latest(kind, request, tmp_path, monkeypatch):
    """keep_last=1 deletes the step a reader is in the middle of loading; the reader follows `latest` again."""
    store = make_store(kind, request, tmp_path)
    writer = CheckpointStore(store, PREFIX, keep_last=1)
    writer.save(1, {"a": b"1a", "b": b"1b"})
    reader_store = ObjectStore(store.url)
    real_get = reader_store.get
    raced = []

    def get(key):
        if key.endswith("step-1/b") and not raced:
            raced.append(key)
            writer.save(2, {"a": b"2a", "b": b"2b"})  # commits step 2 and prunes step 1
        return real_get(key)

    monkeypatch.setattr(reader_store, "get", get)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        latest = CheckpointStore(reader_store, PREFIX).load_latest()
    assert raced and latest is not None and latest.step == 2 and latest.files == {"a": b"2a", "b": b"2b"}
    assert writer.steps() == [2]


def test_prune_never_deletes_what_latest_names(tmp_path):
    """Another writer's commit between our commit and our pruning is protected."""
    store = ObjectStore(str(tmp_path))
    ours = CheckpointStore(store, PREFIX, keep_last=1, writer="ours")
    for step in (1, 2):
        ours.save(step, {"w": bytes([step])})
    # A writer with an older view resumed from step 1 and commits step 1 again,
    # right after our next commit and before our pruning runs.
    theirs = CheckpointStore(store, PREFIX, keep_last=3, writer="theirs")
    real_prune = CheckpointStore._prune

    def prune(self, pointer):
        if self is ours:
            theirs.save(1, {"w": b"resumed"})
        return real_prune(self, pointer)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(CheckpointStore, "_prune", prune)
    try:
        ours.save(3, {"w": b"\x03"})
    finally:
        monkeypatch.undo()
    reader = CheckpointStore(store, PREFIX)
    assert reader.load_latest().files == {"w": b"resumed"}


# -- coordinator state and a whole training run on S3 ----------------------------------


def test_coordinator_state_on_s3(s3_env, bucket):
    store = ObjectStore(f"s3://{bucket}/tinkerless")
    coord = Coordinator.create(store, "s3-run", {"steps": 2})
    coord.begin_rollout(0, ["a", "b"])
    coord.submit_rollout(0, "a")

    reopened = Coordinator.open(ObjectStore(f"s3://{bucket}/tinkerless"), "s3-run")  # as a restarted process
    assert reopened.state.phase == Phase.ROLLOUT and reopened.state.missing_rollouts() == ["b"]
    reopened.submit_rollout(0, "b")
    reopened.begin_update(0)
    reopened.commit_update(0, {"reward": 0.5})
    assert [r.run_id for r in list_runs(store)] == ["s3-run"]
    (state,) = list_runs(store)
    assert state.step == 1 and state.summary["last_metrics"] == {"reward": 0.5}
    with pytest.raises(UserError, match="already exists"):
        Coordinator.create(store, "s3-run", {})


def vowel_reward(completion: str, task: dict) -> float:
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)


def test_train_and_resume_on_s3(s3_env, bucket, tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # local copies of metrics of a remote run go to ./runs/<run_id>
    storage = f"s3://{bucket}/run"
    settings = {
        "model": tiny_model,
        "reward": vowel_reward,
        "tasks": lambda rng: {"prompt": f"say {rng.randint(0, 9)}"},
        "storage": storage,
        "run_id": "s3-train",
        "batch_size": 2,
        "group_size": 2,
        "max_tokens": 4,
        "checkpoint_every": 1,
        "progress": False,
        "seed": 3,
    }
    first = tinkerless.train(steps=2, **settings)
    assert first.last_checkpoint_step == 2
    ckpts = CheckpointStore(ObjectStore(storage), "runs/s3-train/checkpoints")
    assert ckpts.steps() == [1, 2]
    step2 = ckpts.load(2)
    assert "adapter/adapter_model.safetensors" in step2.files and "client.json" in step2.files

    resumed = tinkerless.train(steps=3, resume=True, **settings)
    assert resumed.last_checkpoint_step == 3 and ckpts.steps() == [1, 2, 3]
    assert ckpts.load(2).files == step2.files  # resuming did not touch the committed steps
    (state,) = list_runs(ObjectStore(storage))
    assert state.run_id == "s3-train" and state.status == "finished" and state.step == 3
    assert [r["step"] for r in resumed.metrics] == [0, 1, 2]
    assert ObjectStore(storage).list("runs/s3-train")[-1] == "runs/s3-train/state.json"


def test_train_with_storage_options_naming_the_endpoint(s3_env, bucket, moto, tiny_model, tmp_path, monkeypatch):
    """An S3-compatible endpoint given in TrainConfig.storage_options, not the environment; kept out of run state."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    options = {"client_kwargs": {"endpoint_url": moto.endpoint}}
    result = tinkerless.train(
        model=tiny_model, reward=vowel_reward, tasks=lambda rng: {"prompt": "say 1"}, storage=f"s3://{bucket}/opts",
        storage_options=options, run_id="opts", steps=1, batch_size=2, group_size=2, max_tokens=4, progress=False,
    )
    assert result.last_checkpoint_step == 1
    (state,) = list_runs(ObjectStore(f"s3://{bucket}/opts", **options))
    assert state.status == "finished" and "storage_options" not in state.config
