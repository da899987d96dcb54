"""A run whose `tinkerless serve` is SIGKILLed and restarted mid-run (same storage, same port) reconnects and
finishes with the adapter of a run that was never interrupted, byte for byte."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.errors import ServerUnreachable
from tinkerless.sdk.backends.http import HTTPBackend

pytestmark = pytest.mark.timeout(600)
STEPS = 6


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# A `tinkerless serve` process that has done its imports (torch, transformers, the worker: most of a start on a
# busy 2-core machine) and waits for its go file, then runs the real CLI `serve` from the top: it loads the
# model, opens the storage and binds the port as a cold start does. So the next server is warm while the run
# goes on, and a restart costs what the server itself does at start, not Python importing its libraries.
_STANDBY = """
import os, sys, time
import torch, transformers, peft, uvicorn, fastapi, tinkerless.functions.worker, tinkerless.server.serving
import tinkerless.server.app, tinkerless.server.runs, tinkerless.sdk.cli.commands
import transformers.models.qwen2.modeling_qwen2  # the tiny model's class, which transformers imports lazily
go = sys.argv[1]
while not os.path.exists(go):
    time.sleep(0.01)
from tinkerless.sdk.cli.commands import main
raise SystemExit(main(sys.argv[2:]))
"""


class _Serve:
    """`tinkerless serve` as a process of its own, restartable on the same port and storage (SIGKILL, then a
    fresh process: the next one is started ahead, its imports done, and waits for its turn)."""

    def __init__(self, model: str, storage: Path):
        self.model, self.storage, self.port = model, storage, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.standby: tuple[subprocess.Popen, Path] | None = None
        self.starts = 0

    def _spawn(self) -> tuple[subprocess.Popen, Path]:
        go = self.storage.parent / f"go-{self.port}-{self.starts}"
        argv = ["serve", "--model", self.model, "--port", str(self.port), "--no-auth", "--single-user",
                "--storage", str(self.storage), "--threads", "1"]
        process = subprocess.Popen([sys.executable, "-c", _STANDBY, str(go), *argv],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return process, go

    def start(self) -> None:
        self.process, go = self.standby or self._spawn()
        self.starts += 1
        go.touch()
        self.standby = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    self.standby = self._spawn()  # the next restart's server, importing while this one serves
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError("the server did not start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def close(self) -> None:
        self.kill()
        if self.standby is not None:
            self.standby[0].kill()
            self.standby[0].wait()


def _train(model: str, storage: Path, url: str, run_id: str, **extra):
    return tinkerless.train(
        model=model, name="ride", reward=lambda c, t: float(len(c) % 3), tasks=lambda rng: {"prompt": f"n {rng.randint(0, 9)}"},
        steps=STEPS, batch_size=2, group_size=2, max_tokens=4, temperature=1.0, learning_rate=1e-2, checkpoint_every=2,
        keep_checkpoints=None, seed=3, storage=str(storage), progress=False, run_id=run_id, backend=HTTPBackend(url),
        **extra,
    )


def _adapter(server_storage: Path, run_id: str) -> dict:
    [path] = server_storage.glob(f"**/runs/{run_id}/checkpoints/step-{STEPS}/adapter/adapter_model.safetensors")
    return load_safetensors(path.read_bytes())


def test_a_client_rides_out_its_server_killed_and_restarted_at_random_points(tiny_model, tmp_path, capsys):
    server = _Serve(tiny_model, tmp_path / "server")
    server.start()
    try:
        straight = _train(tiny_model, tmp_path / "client", server.url, "straight")
        for seed in range(3):
            rng = random.Random(seed)
            restarts: list[float] = []

            after, pause = rng.randrange(STEPS - 1), rng.uniform(0.0, 0.3)
            metrics = tmp_path / "client" / "runs" / f"ridden-{seed}" / "metrics.jsonl"

            def kill_and_restart() -> None:
                # After a random step's line, a random moment later: a call in flight, or between calls.
                while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
                    time.sleep(0.01)
                time.sleep(pause)
                server.kill()
                restarts.append(time.monotonic())
                server.start()

            killer = threading.Thread(target=kill_and_restart, daemon=True)
            killer.start()
            ridden = _train(tiny_model, tmp_path / "client", server.url, f"ridden-{seed}")
            killer.join(timeout=150)
            assert restarts, "the server was never killed"
            assert capsys.readouterr().err.count("the server is back; resuming from the last checkpoint") == 1
            expected, actual = _adapter(tmp_path / "server", "straight"), _adapter(tmp_path / "server", f"ridden-{seed}")
            assert expected.keys() == actual.keys() and expected
            for name in expected:
                assert (expected[name] == actual[name]).all(), f"seed {seed}: {name} differs"
            assert [m["reward_mean"] for m in ridden.metrics] == [m["reward_mean"] for m in straight.metrics]
            assert [m["step"] for m in ridden.metrics] == list(range(STEPS))
        # Without a reconnect window, a lost server fails the run at once, resumably.
        server.kill()
        with pytest.raises(ServerUnreachable):
            _train(tiny_model, tmp_path / "client", server.url, "gone", reconnect_timeout=0)
    finally:
        server.close()
