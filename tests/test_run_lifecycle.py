"""How a run ends: SIGTERM like Ctrl-C, a vanished process shown as interrupted (heartbeat), no lock files left."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import write_resumable_example
from test_s3_storage import bucket, moto, s3_env  # noqa: F401  (fixtures: a real S3 API on localhost)

from tinkerless.coordinator import Coordinator, Phase, list_runs
from tinkerless.coordinator.state import stale_after
from tinkerless.errors import ConfigError, PhaseError, UserError
from tinkerless.sdk.run.lifecycle import Heartbeat, RunInterrupted, heartbeat_interval, interruptible, uninterrupted
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.storage.local import TMP_MARK

CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]
STEPS = 6
BEAT = 1.0  # seconds between heartbeats in the subprocess runs: stale after stale_after(BEAT)


def _start(example: Path, storage: Path, *extra: str) -> subprocess.Popen:
    cmd = [*CLI, "train", str(example), "--storage", str(storage), "--run-id", "r", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKERLESS_HEARTBEAT_S": str(BEAT)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _state(storage: Path) -> dict:
    return json.loads((storage / "runs/r/state.json").read_text())


def _wait_for_checkpoint(proc: subprocess.Popen, storage: Path, step: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (storage / "runs/r/checkpoints").exists():
            latest = CheckpointStore(ObjectStore(str(storage)), "runs/r/checkpoints").latest_step()
            if latest is not None and latest >= step:
                return
        time.sleep(0.05)
    out = proc.communicate()[0] if proc.poll() is not None else ""
    pytest.fail(f"no checkpoint step-{step} while the run was alive; output:\n{out}")


def _leftovers(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if TMP_MARK in p.name]


@pytest.fixture()
def example(tmp_path, tiny_model) -> Path:
    return write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)


def test_sigterm_marks_the_run_interrupted_names_it_and_it_resumes(tmp_path, example):
    storage = tmp_path / "store"
    proc = _start(example, storage)
    _wait_for_checkpoint(proc, storage, 2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "interrupted by SIGTERM" in out and "--resume --run-id r" in out and "<id>" not in out, out
    state = _state(storage)
    assert (state["status"], state["phase"]) == ("interrupted", "interrupted")
    [listed] = list_runs(ObjectStore(str(storage)))
    assert listed.status == "interrupted"
    # What the run left is consistent: its latest checkpoint verifies, and no temp or lock file is left.
    checkpoints = CheckpointStore(ObjectStore(str(storage)), "runs/r/checkpoints")
    latest = checkpoints.latest_step()
    assert latest is not None and latest >= 2 and checkpoints.load(latest).step == latest
    assert _leftovers(storage) == []

    resumed = _start(example, storage, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert _state(storage)["status"] == "finished" and _state(storage)["step"] == STEPS
    metrics = [json.loads(line)["step"] for line in (storage / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert metrics == list(range(STEPS))
    # Transcripts: the default sample of 4 episodes for every step, none twice after the resume.
    episodes = [json.loads(line) for line in (storage / "runs/r/episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == [s for s in range(STEPS) for _ in range(4)]
    assert _leftovers(storage) == [], "a finished run leaves no temp or lock files"


def test_sigkill_run_lists_as_interrupted_once_its_heartbeat_is_stale(tmp_path, example, capsys):
    from tinkerless.sdk.cli.commands import main

    storage = tmp_path / "store"
    proc = _start(example, storage)
    try:
        _wait_for_checkpoint(proc, storage, 1)
        [alive] = list_runs(ObjectStore(str(storage)))
        assert alive.status == "running" and alive.heartbeat_interval == BEAT
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed_at = time.time()
    assert _state(storage)["status"] == "running", "nothing could mark a SIGKILLed run"

    deadline = killed_at + stale_after(BEAT) + 30
    while list_runs(ObjectStore(str(storage)))[0].status == "running":
        assert time.time() < deadline, "the run still lists as running long after its heartbeat stopped"
        time.sleep(0.25)
    assert time.time() - _state(storage)["heartbeat_at"] > stale_after(BEAT)
    assert main(["runs", "--storage", str(storage)]) == 0
    assert "interrupted" in capsys.readouterr().out
    assert _state(storage)["status"] == "running", "listing does not rewrite the stored state"


# ---- the heartbeat in the run state -------------------------------------------------------------


def test_heartbeat_is_recorded_and_goes_stale(tmp_path):
    store = ObjectStore(str(tmp_path))
    coordinator = Coordinator.create(store, "hb", {})
    coordinator.heartbeat(2.0)
    state = Coordinator.open(store, "hb").state
    assert state.heartbeat_interval == 2.0 and abs(state.heartbeat_at - time.time()) < 5
    assert not state.heartbeat_stale(state.heartbeat_at + stale_after(2.0))
    assert state.heartbeat_stale(state.heartbeat_at + stale_after(2.0) + 0.01)
    for bad in (0, -1, float("nan"), float("inf"), True, "30", None):
        with pytest.raises(UserError, match="interval"):
            coordinator.heartbeat(bad)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_heartbeat_thread_and_the_driving_thread_share_the_run_state(kind, tmp_path, request):
    """Beats land between transitions without a compare-and-swap conflict, on a local disk and on S3."""
    url = str(tmp_path) if kind == "local" else f"s3://{request.getfixturevalue('bucket')}/root"
    store = ObjectStore(url)
    coordinator = Coordinator.create(store, "shared", {})
    heartbeat = Heartbeat(coordinator, 0.02).start()
    try:
        for step in range(5):
            coordinator.begin_rollout(step, ["default"])
            coordinator.submit_rollout(step, "default")
            coordinator.begin_update(step)
            coordinator.commit_update(step, {"reward_mean": 0.0})
    finally:
        heartbeat.stop()
    state = Coordinator.open(store, "shared").state
    assert state.step == 5 and state.heartbeat_interval == 0.02 and state.heartbeat_at > state.created_at
    assert list_runs(store)[0].status == "running"
    time.sleep(stale_after(0.02) + 0.2)
    assert list_runs(store)[0].status == "interrupted"


def test_a_run_without_heartbeats_or_no_longer_running_is_never_stale(tmp_path):
    store = ObjectStore(str(tmp_path))
    old = Coordinator.create(store, "old", {})  # a run from before heartbeats: interval 0
    assert not old.state.heartbeat_stale(time.time() + 10**6)
    done = Coordinator.create(store, "done", {})
    done.heartbeat(1.0)
    done.finish("finished")
    done.heartbeat(1.0)  # a late beat from the heartbeat thread changes nothing
    assert not done.state.heartbeat_stale(time.time() + 10**6)
    assert {r.run_id: r.status for r in list_runs(store)} == {"old": "running", "done": "finished"}


def test_interrupted_run_stops_barrier_waiters_and_resumes(tmp_path):
    store = ObjectStore(str(tmp_path))
    coordinator = Coordinator.create(store, "int", {})
    coordinator.begin_rollout(0, ["a", "b"])
    coordinator.finish("interrupted", {"note": "ctrl-c"})
    assert coordinator.state.phase == Phase.INTERRUPTED
    with pytest.raises(PhaseError, match="interrupted"):
        coordinator.wait_rollouts(0, timeout=1)
    reopened = Coordinator.open(store, "int")
    reopened.heartbeat(1.0)
    assert reopened.state.heartbeat_at == 0.0, "an interrupted run takes no heartbeat until it is resumed"
    reopened.reset_to_checkpoint(0)
    assert reopened.state.status == "running" and not reopened.state.heartbeat_stale(time.time())
    with pytest.raises(UserError, match="'finished', 'failed' or 'interrupted'"):
        reopened.finish("running")


def test_server_hosted_run_takes_heartbeats(tiny_model, worker, tmp_path):
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.sdk.backends.server_runs import ServerRunHost
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    with running(create_app(worker, storage=str(tmp_path / "server"))) as url:
        host = ServerRunHost(HTTPBackend(url))
        coordinator = host.create("remote", {"name": "remote"})
        coordinator.heartbeat(0.2)
        [listed] = host.list()
        assert listed.heartbeat_interval == 0.2 and listed.status == "running"
        time.sleep(stale_after(0.2) + 0.5)
        assert host.list()[0].status == "interrupted"  # judged by the server, on its own clock
        coordinator.heartbeat(0.2)
        assert host.list()[0].status == "running"
        with pytest.raises(UserError, match="interval"):
            coordinator.heartbeat(-1)


def test_heartbeat_interval_from_the_environment(monkeypatch):
    monkeypatch.delenv("TINKERLESS_HEARTBEAT_S", raising=False)
    assert heartbeat_interval() == 30.0
    monkeypatch.setenv("TINKERLESS_HEARTBEAT_S", "2.5")
    assert heartbeat_interval() == 2.5
    for bad in ("0", "-3", "abc", "nan", "1e9"):
        monkeypatch.setenv("TINKERLESS_HEARTBEAT_S", bad)
        with pytest.raises(ConfigError, match="TINKERLESS_HEARTBEAT_S"):
            heartbeat_interval()


# ---- signals ------------------------------------------------------------------------------------


def test_sigterm_raises_run_interrupted_but_waits_for_a_critical_section():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as caught, interruptible():
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler ran, and held the signal back
            finished_section = True
        pytest.fail("the held-back signal must be raised when the section ends")
    assert finished_section and caught.value.signal_name == "SIGTERM" and caught.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before, "the previous handler is restored"


def test_run_interrupted_message_names_the_run():
    assert "resume it with --resume --run-id run-7" in str(RunInterrupted("SIGINT", "run-7", 3))
    assert "last checkpoint step-3" in str(RunInterrupted("SIGINT", "run-7", 3))
    assert "nothing to resume" in str(RunInterrupted("SIGTERM"))
    assert RunInterrupted("SIGINT").exit_code == 130


# ---- lock files ---------------------------------------------------------------------------------


def _increment(root: str, times: int) -> None:
    store = ObjectStore(root)
    for _ in range(times):
        while True:
            data, version = store.get_with_version("counter")
            try:
                store.put_if("counter", str(int(data) + 1).encode(), match=version)
                break
            except Exception:  # lost the race: read again
                continue


def test_conditional_writes_stay_exclusive_and_leave_no_lock_files(tmp_path):
    """Lock files are deleted by their holder; processes and threads racing on one key still lose no update."""
    store = ObjectStore(str(tmp_path))
    store.put_if("counter", b"0", match=None)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_increment, args=(str(tmp_path), 40)) for _ in range(2)]
    threads = [threading.Thread(target=_increment, args=(str(tmp_path), 40)) for _ in range(3)]
    for worker in (*processes, *threads):
        worker.start()
    for worker in (*processes, *threads):
        worker.join(timeout=120)
    assert all(p.exitcode == 0 for p in processes)
    assert store.get("counter") == str(5 * 40).encode()
    assert _leftovers(tmp_path) == []


CTRL_C_FILE = """\
import os
import tinkerless

COUNTER = {counter!r}


@tinkerless.reward
def ctrl_c_at_step_2(completion, task):
    calls = int(open(COUNTER).read()) if os.path.exists(COUNTER) else 0
    open(COUNTER, "w").write(str(calls + 1))
    if calls == 8:  # the first episode of step 2 (batch 2 x group 2 per step)
        raise KeyboardInterrupt
    return float(len(completion) % 3)


config = tinkerless.TrainConfig(
    model={model!r}, reward=ctrl_c_at_step_2, tasks=[{{"prompt": "a"}}, {{"prompt": "b"}}], steps=5, batch_size=2,
    group_size=2, max_tokens=4, checkpoint_every=1, storage={storage!r}, progress=False,
)
"""


def test_ctrl_c_in_process_names_the_real_run_id(tmp_path, tiny_model, capsys):
    from tinkerless.sdk.cli.commands import main

    file = tmp_path / "ctrl_c.py"
    file.write_text(CTRL_C_FILE.format(counter=str(tmp_path / "calls"), model=tiny_model, storage=str(tmp_path / "s")))
    assert main(["train", str(file), "--run-id", "ctrl-c-run"]) == 130
    err = capsys.readouterr().err
    assert "run ctrl-c-run interrupted by SIGINT (last checkpoint step-2)" in err
    assert f"tinkerless train {file} --resume --run-id ctrl-c-run" in err and "<id>" not in err
    state = json.loads((tmp_path / "s/runs/ctrl-c-run/state.json").read_text())
    assert state["status"] == "interrupted" and state["summary"]["usage"]["compute_seconds_total"] >= 0
