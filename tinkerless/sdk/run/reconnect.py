"""Riding out the server: a run through a `tinkerless serve` that died or restarted mid-run reconnects and finishes.

A call whose connection broke, or a server that cannot be reached, raises `ServerUnreachable`. Once the run
existed on the server, `train()` does not fail then: it waits for the server to answer again (backoff from
0.5 s to 5 s, up to `TrainConfig.reconnect_timeout` seconds), opens a fresh call stream and resumes the run
from its last checkpoint, as `--resume` would. The server keeps runs and checkpoints in its storage, and a
resume is exact (docs/errors.md), so the run ends with the adapter of one that was never interrupted. Work
after the last checkpoint is done again: `checkpoint_every` bounds how much.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from tinkerless.errors import ServerUnreachable
from tinkerless.sdk.config import TrainConfig


def reconnecting(start: Callable[[TrainConfig], Any], config: TrainConfig, backend: Any) -> Any:
    """`start(config)`, resumed after each time its server went away and came back within the timeout."""
    from tinkerless.sdk.backends.http import wait_for_server, wait_listeners

    while True:
        try:
            return start(config)
        except ServerUnreachable as exc:
            run_id = getattr(exc, "run_id", None)  # set once the run existed on the server (`_Run._stop`)
            url = getattr(backend, "base_url", None) or (config.backend if config.backend.startswith("http") else None)
            if run_id is None or url is None or config.reconnect_timeout <= 0:
                raise

            def say(seconds: float, why: str) -> None:
                for listener in list(wait_listeners):
                    listener(seconds, why)

            print(f"run {run_id}: lost the server ({exc.message}); waiting up to {config.reconnect_timeout:g}s for it",
                  file=sys.stderr, flush=True)
            if not wait_for_server(url, config.reconnect_timeout, on_wait=say):
                raise
            if hasattr(backend, "reopen"):
                backend.reopen()
            print(f"run {run_id}: the server is back; resuming from the last checkpoint", file=sys.stderr, flush=True)
            config = config.replace(resume=True, run_id=run_id)
