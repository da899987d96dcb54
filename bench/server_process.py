"""`tinkerless serve` in a process of its own, for benchmarks that drive it as an outside client would.

A client on another machine shares no interpreter (no GIL, no event loop) with the server, so
the benchmarks run the server as a separate process on 127.0.0.1 with a fresh storage
directory and API key, and stop it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


@dataclass
class Served:
    url: str
    api_key: str
    log: Path


def _tinkerless(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from tinkerless.sdk.cli.commands import main; sys.exit(main())", *args]


@contextlib.contextmanager
def serve_process(
    model: str, root: Path, *, env: dict[str, str] | None = None, threads: int | None = None, timeout: float = 180.0
) -> Iterator[Served]:
    """Serve `model` from a new process, storage under `root`; yields its URL and a tenant's key."""
    root.mkdir(parents=True, exist_ok=True)
    storage = root / "storage"
    key = subprocess.run(_tinkerless("keys", "create", "--tenant", "bench", "--storage", str(storage)),
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["serve", "--model", model, "--storage", str(storage), "--port", str(port)]
    if threads is not None:
        args += ["--threads", str(threads)]
    log = root / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(_tinkerless(*args), env={**os.environ, **(env or {})}, stdout=out,
                                  stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start; its log:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.2)
        yield Served(url, key, log)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
