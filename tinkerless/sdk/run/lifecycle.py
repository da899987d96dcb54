"""How a run stops and shows that it is alive: Ctrl-C and SIGTERM, and the heartbeat.

- SIGTERM (what `kill`, systemd, Kubernetes and schedulers send) is handled like Ctrl-C:
  both raise `RunInterrupted`, the run is marked `interrupted` with what it used, and the
  message names the real run id to resume. A signal that lands while a checkpoint is being
  written waits until the checkpoint is whole (a second signal does not wait).
- The heartbeat: a daemon thread renews the run state's `heartbeat_at` every
  `heartbeat_interval()` seconds, so `tinkerless runs` shows a run whose process vanished
  without a word (SIGKILL, a lost machine) as `interrupted` instead of `running` forever.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any, Iterator

from tinkerless.errors import ConfigError

logger = logging.getLogger(__name__)

HEARTBEAT_ENV = "TINKERLESS_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 30.0
_HANDLED = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C or SIGTERM; `run_id` (None if it stopped before the run existed) says what to resume."""

    def __init__(self, signal_name: str = "SIGINT", run_id: str | None = None, checkpoint_step: int | None = None):
        super().__init__(signal_name, run_id, checkpoint_step)
        self.signal_name = signal_name
        self.run_id = run_id
        self.checkpoint_step = checkpoint_step

    @property
    def exit_code(self) -> int:
        """The shell's code for death by this signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + int(getattr(signal, self.signal_name, signal.SIGINT))

    def __str__(self) -> str:
        if self.run_id is None:
            return f"interrupted by {self.signal_name} before the run started; nothing to resume"
        where = "no checkpoint yet, a resume starts at step 0" if self.checkpoint_step is None else f"last checkpoint step-{self.checkpoint_step}"
        return f"run {self.run_id} interrupted by {self.signal_name} ({where}); resume it with --resume --run-id {self.run_id}"


def heartbeat_interval() -> float:
    """Seconds between heartbeats: $TINKERLESS_HEARTBEAT_S, default 30."""
    raw = os.environ.get(HEARTBEAT_ENV)
    if raw is None or raw == "":
        return DEFAULT_HEARTBEAT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:
        raise ConfigError(f"${HEARTBEAT_ENV}={raw!r} is not a number of seconds in (0, 3600]", hint="e.g. 30, or unset it")
    return value


class Heartbeat:
    """Calls `coordinator.heartbeat(interval)` now and then every `interval` seconds until `stop()`."""

    def __init__(self, coordinator: Any, interval: float):
        self.coordinator = coordinator
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tinkerless-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 30)

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            self._beat()

    def _beat(self) -> None:
        try:
            self.coordinator.heartbeat(self.interval)
        except Exception as exc:  # a missed beat is not worth failing a run for; staleness shows it
            logger.warning("heartbeat of run %s failed: %s", getattr(self.coordinator, "run_id", "?"), exc)


class _Signals:
    """Turns SIGINT/SIGTERM into RunInterrupted, holding them back inside `critical()` sections."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.depth = 0

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.depth and self.pending is None:
            self.pending = name  # raised when the critical section ends; a second signal goes through
            print(f"tinkerless: {name}: stopping once the checkpoint or run state being written is complete "
                  "(send it again to stop at once)", file=sys.stderr, flush=True)
            return
        raise RunInterrupted(name)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if not self.depth and self.pending is not None:
            name, self.pending = self.pending, None
            raise RunInterrupted(name)


_active: _Signals | None = None


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within this block SIGINT and SIGTERM raise RunInterrupted (main thread only; elsewhere a no-op)."""
    global _active
    if threading.current_thread() is not threading.main_thread() or _active is not None:
        yield
        return
    signals = _Signals()
    previous = {sig: signal.getsignal(sig) for sig in _HANDLED}
    for sig in _HANDLED:
        signal.signal(sig, signals.handle)
    _active = signals
    try:
        yield
    finally:
        _active = None
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A section a signal must not cut (a checkpoint being written): the signal is raised after it."""
    if _active is None:
        yield
    else:
        with _active.critical():
            yield
