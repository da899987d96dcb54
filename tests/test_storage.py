"""ObjectStore and CheckpointStore against real local directories."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from tinkerless.errors import ConfigError, CorruptCheckpoint, StorageNotFound, UserError
from tinkerless.storage import Checkpoint, CheckpointStore, ObjectStore, validate_key


# -- ObjectStore ---------------------------------------------------------------


def test_put_get_round_trip(tmp_path):
    store = ObjectStore(str(tmp_path / "root"))
    assert store.url == str(tmp_path / "root")
    assert os.path.isdir(store.url)  # created on demand
    store.put("a/b/c.bin", b"\x00\x01hello")
    assert store.get("a/b/c.bin") == b"\x00\x01hello"
    assert store.exists("a/b/c.bin")
    assert not store.exists("a/b")  # a prefix is not an object
    assert not store.exists("a/b/missing")
    assert store.local_path("a/b/c.bin") == os.path.join(store.url, "a", "b", "c.bin")
    assert Path(store.local_path("a/b/c.bin")).read_bytes() == b"\x00\x01hello"


def test_get_missing_names_full_url(tmp_path):
    store = ObjectStore(str(tmp_path))
    with pytest.raises(StorageNotFound) as info:
        store.get("nope/x.json")
    assert os.path.join(str(tmp_path), "nope/x.json") in str(info.value)
    assert info.value.hint


def test_atomic_overwrite_leaves_no_temp_files(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put("k", b"first version")
    store.put("k", b"second")
    assert store.get("k") == b"second"
    assert os.listdir(tmp_path) == ["k"]
    assert store.list() == ["k"]


def test_crashed_temp_file_is_not_listed(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.put("d/real", b"1")
    # What a crash between mkstemp and os.replace leaves behind.
    (tmp_path / "d" / ".tinkerless-tmp-abc123").write_bytes(b"partial")
    assert store.list() == ["d/real"]


def test_put_requires_bytes(tmp_path):
    store = ObjectStore(str(tmp_path))
    with pytest.raises(UserError):
        store.put("k", "text")  # type: ignore[arg-type]


def test_list_and_delete(tmp_path):
    store = ObjectStore(str(tmp_path))
    for key in ["runs/r1/state.json", "runs/r1/ckpt/step-1/w", "runs/r2/state.json", "other"]:
        store.put(key, key.encode())
    assert store.list() == sorted(["other", "runs/r1/ckpt/step-1/w", "runs/r1/state.json", "runs/r2/state.json"])
    assert store.list("runs/r1") == ["runs/r1/ckpt/step-1/w", "runs/r1/state.json"]
    assert store.list("runs/r1/") == store.list("runs/r1")
    assert store.list("runs/r1/state.json") == ["runs/r1/state.json"]
    assert store.list("missing") == []

    store.delete("runs/r1")  # whole prefix
    assert store.list("runs") == ["runs/r2/state.json"]
    store.delete("other")  # single object
    assert not store.exists("other")
    store.delete("does/not/exist")  # missing is fine
    with pytest.raises(UserError):
        store.delete("")  # never the whole root by accident


def test_file_url_and_memory_store(tmp_path):
    store = ObjectStore(f"file://{tmp_path}")
    assert store.url == str(tmp_path)
    store.put("x", b"1")
    assert (tmp_path / "x").read_bytes() == b"1"

    mem = ObjectStore("memory://tinkerless-test-store")
    mem.put("a/b", b"2")
    assert mem.get("a/b") == b"2"
    assert mem.list() == ["a/b"]
    assert mem.local_path("a/b") is None
    mem.delete("a")
    assert mem.list() == []


@pytest.mark.parametrize(
    "key",
    ["../x", "/abs", "a/../../b", "a\\b", "", "a//b", "a/", "./a", "a/./b", "a\x00b", "..", "C:/x"],
)
def test_validate_key_rejects_unsafe(key, tmp_path):
    with pytest.raises(UserError) as info:
        validate_key(key)
    assert info.value.hint
    store = ObjectStore(str(tmp_path / "root"))
    for op in (lambda: store.put(key, b"x"), lambda: store.get(key), lambda: store.exists(key)):
        with pytest.raises(UserError):
            op()
    assert not (tmp_path / "x").exists()


def test_validate_key_accepts_normal_keys():
    for key in ["a", "runs/r-1/state.json", "step-3/adapter/adapter_model.safetensors", "a..b", ".hidden"]:
        assert validate_key(key) == key


# -- CheckpointStore -----------------------------------------------------------


FILES = {
    "adapter/adapter_model.safetensors": b"\x01\x02\x03" * 100,
    "adapter/adapter_config.json": b'{"r": 8}',
    "optimizer.pt": b"opt-state",
}


def make_ckpts(tmp_path, keep_last=None) -> CheckpointStore:
    return CheckpointStore(ObjectStore(str(tmp_path)), "runs/r1/checkpoints", keep_last=keep_last)


def test_checkpoint_round_trip(tmp_path):
    ckpts = make_ckpts(tmp_path)
    assert ckpts.load_latest() is None
    assert ckpts.latest_step() is None
    assert ckpts.save(1, FILES, {"loss": 0.5}) == "runs/r1/checkpoints/step-1"
    loaded = ckpts.load(1)
    assert loaded == Checkpoint(step=1, files=FILES, metadata={"loss": 0.5})

    manifest = json.loads(ckpts.store.get("runs/r1/checkpoints/step-1/manifest.json"))
    assert manifest["step"] == 1 and manifest["created_at"] > 0
    assert manifest["files"]["optimizer.pt"]["size"] == len(b"opt-state")
    pointer = json.loads(ckpts.store.get("runs/r1/checkpoints/latest"))
    assert (pointer["step"], pointer["dir"], pointer["history"]) == (1, "step-1", [[1, "step-1"]])
    assert pointer["writer"] == ckpts.writer

    ckpts.save(2, {"optimizer.pt": b"v2"})
    assert ckpts.steps() == [1, 2]
    assert ckpts.latest_step() == 2
    latest = ckpts.load_latest()
    assert latest is not None and latest.step == 2 and latest.files == {"optimizer.pt": b"v2"}


def test_resave_replaces_stale_files(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    where = ckpts.save(1, {"only.bin": b"x"})
    # step-1 is claimed by the first save, so the resave writes a directory of
    # its own: stale files can't mix with the new ones, and nothing is deleted
    # that `latest` still points to while the resave runs.
    assert where.startswith("runs/r1/checkpoints/step-1.") and ckpts.location(1) == where
    assert ckpts.store.list(where) == [f"{where}/manifest.json", f"{where}/only.bin"]
    assert ckpts.load(1).files == {"only.bin": b"x"}
    ckpts.save(2, {"only.bin": b"y"})
    assert ckpts.store.list(ckpts.step_prefix(1)) == []  # the superseded step-1 is pruned by the next save
    assert ckpts.load(1).files == {"only.bin": b"x"}


def test_save_rejects_bad_input(tmp_path):
    ckpts = make_ckpts(tmp_path)
    with pytest.raises(UserError):
        ckpts.save(1, {"../escape": b"x"})
    with pytest.raises(UserError):
        ckpts.save(1, {"manifest.json": b"x"})
    with pytest.raises(UserError):
        ckpts.save(-1, {"a": b"x"})
    with pytest.raises(UserError):
        ckpts.save(1, {"a": b"x"}, {"bad": object()})
    with pytest.raises(ConfigError):
        make_ckpts(tmp_path, keep_last=0)
    assert ckpts.steps() == []


def test_corrupted_file_detected_and_latest_falls_back(tmp_path, caplog):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    ckpts.save(2, FILES)
    path = ckpts.store.local_path("runs/r1/checkpoints/step-2/adapter/adapter_model.safetensors")
    data = bytearray(Path(path).read_bytes())
    data[10] ^= 0xFF  # same size, different content
    Path(path).write_bytes(bytes(data))

    with pytest.raises(CorruptCheckpoint) as info:
        ckpts.load(2)
    assert "adapter/adapter_model.safetensors" in str(info.value) and "step 2" in str(info.value)

    with caplog.at_level(logging.WARNING), pytest.warns(RuntimeWarning, match="skipped checkpoint step 2"):
        latest = ckpts.load_latest()
    assert latest is not None and latest.step == 1 and latest.files == FILES
    assert "skipped checkpoint step 2" in caplog.text


def test_truncated_or_missing_file_and_bad_manifest(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    ckpts.store.put("runs/r1/checkpoints/step-1/optimizer.pt", b"opt")  # truncated
    with pytest.raises(CorruptCheckpoint, match="optimizer.pt"):
        ckpts.load(1)
    ckpts.store.delete("runs/r1/checkpoints/step-1/optimizer.pt")
    with pytest.raises(CorruptCheckpoint, match="missing"):
        ckpts.load(1)
    ckpts.store.put("runs/r1/checkpoints/step-1/manifest.json", b"{not json")
    with pytest.raises(CorruptCheckpoint, match="manifest.json"):
        ckpts.load(1)
    with pytest.warns(RuntimeWarning, match="step 1"):
        assert ckpts.load_latest() is None


def test_tampered_manifest_cannot_escape(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, {"a": b"x"})
    manifest = json.loads(ckpts.store.get("runs/r1/checkpoints/step-1/manifest.json"))
    manifest["files"]["../../../evil"] = {"sha256": "0" * 64, "size": 1}
    ckpts.store.put("runs/r1/checkpoints/step-1/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(CorruptCheckpoint, match="unsafe file name"):
        ckpts.load(1)


def test_half_written_checkpoint_is_skipped(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    # A crash while writing step 2: files are there, the manifest is not.
    ckpts.store.put("runs/r1/checkpoints/step-2/optimizer.pt", b"partial")
    assert ckpts.steps() == [1]
    assert ckpts.latest_step() == 1
    with pytest.raises(CorruptCheckpoint, match="no manifest.json"):
        ckpts.load(2)
    latest = ckpts.load_latest()  # pointer still says 1, so no warning is needed
    assert latest is not None and latest.step == 1

    # `latest` pointing at a step with no manifest: skipped with a warning.
    ckpts.store.put("runs/r1/checkpoints/latest", b'{"step": 2}')
    assert ckpts.latest_step() == 1
    with pytest.warns(RuntimeWarning, match="skipped checkpoint step 2"):
        latest = ckpts.load_latest()
    assert latest is not None and latest.step == 1

    # `latest` pointing at a step that does not exist at all.
    ckpts.store.put("runs/r1/checkpoints/latest", b'{"step": 7}')
    with pytest.warns(RuntimeWarning, match="skipped checkpoint step 7"):
        assert ckpts.load_latest().step == 1


def test_missing_or_garbled_pointer_uses_newest_manifest(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    ckpts.save(2, FILES)
    ckpts.store.delete("runs/r1/checkpoints/latest")  # crash between manifest and pointer
    assert ckpts.load_latest().step == 2
    ckpts.store.put("runs/r1/checkpoints/latest", b"garbage")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert ckpts.load_latest().step == 2


def test_load_missing_step_is_not_found(tmp_path):
    ckpts = make_ckpts(tmp_path)
    ckpts.save(1, FILES)
    with pytest.raises(StorageNotFound, match=r"available steps: \[1\]"):
        ckpts.load(5)


def test_pointer_ignores_abandoned_newer_steps(tmp_path):
    ckpts = make_ckpts(tmp_path)
    for step in (1, 2, 3):
        ckpts.save(step, {"w": f"v{step}".encode()})
    ckpts.save(2, {"w": b"v2-resumed"})  # resumed from 2 after step 3 was abandoned
    assert ckpts.latest_step() == 2
    assert ckpts.load_latest().files == {"w": b"v2-resumed"}


def test_keep_last_prunes_older(tmp_path):
    ckpts = make_ckpts(tmp_path, keep_last=2)
    ckpts.store.put("runs/r1/checkpoints/step-0/junk", b"half-written")
    for step in range(1, 6):
        ckpts.save(step, {"w": bytes([step])})
    assert ckpts.steps() == [4, 5]
    assert not ckpts.store.list("runs/r1/checkpoints/step-0")  # half-written leftovers go too
    assert ckpts.load_latest().files == {"w": b"\x05"}

    one = CheckpointStore(ckpts.store, "runs/r1/checkpoints", keep_last=1)
    one.save(6, {"w": b"6"})
    assert one.steps() == [6]


def test_materialize(tmp_path):
    ckpts = make_ckpts(tmp_path / "store")
    ckpts.save(3, FILES)
    dest = ckpts.materialize(3, str(tmp_path / "out"))
    assert dest == str(tmp_path / "out")
    for name, data in FILES.items():
        assert (tmp_path / "out" / name).read_bytes() == data
    assert not (tmp_path / "out" / "manifest.json").exists()

    path = ckpts.store.local_path("runs/r1/checkpoints/step-3/optimizer.pt")
    Path(path).write_bytes(b"opt-statX")
    with pytest.raises(CorruptCheckpoint):
        ckpts.materialize(3, str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()  # nothing unverified is written
