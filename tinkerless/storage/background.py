"""`BackgroundSaves`: checkpoint writes on a background thread, off the training loop's critical path.

It runs whatever write it is handed (in practice a `CheckpointStore.save`), one at a
time and in order; the checkpoint format and its atomic commit live in
`tinkerless.storage.checkpoint`, which re-exports this class.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class BackgroundSaves:
    """Runs checkpoint writes on a background thread, one at a time and in order, off the training loop.

    The caller snapshots everything a checkpoint holds first (bytes that later steps cannot change),
    then hands the write here and goes on with the next step. A write is still a normal
    `CheckpointStore.save`: verified files, then an atomic compare-and-swap of `latest`, so a process
    killed mid-write leaves the previous checkpoint in force. At most one write is in flight: submitting
    the next waits for the previous, which bounds memory and keeps commits in step order. `wait()`
    returns once everything submitted is committed and re-raises a write's error there.
    """

    def __init__(self, name: str = "checkpoint-writer") -> None:
        self.name = name
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: object = None
        self._seconds = 0.0  # how long the last write took on its thread

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], object]) -> float:
        """Start `write()` once the previous write is committed; returns the seconds spent waiting for it."""
        waited = self.wait()[1]

        def run() -> None:
            started = time.perf_counter()
            try:
                self._result = write()
            except BaseException as exc:  # re-raised in the training loop by wait()
                self._error = exc
            finally:
                self._seconds = time.perf_counter() - started

        # Not a daemon: an interpreter that exits normally lets the write commit first.
        self._thread = threading.Thread(target=run, name=self.name)
        self._thread.start()
        return waited

    def wait(self) -> tuple[object, float]:
        """Block until the write in flight (if any) is committed: (its result, seconds waited). Raises its error."""
        started = time.perf_counter()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        waited = time.perf_counter() - started
        error, self._error = self._error, None
        if error is not None:
            raise error
        result, self._result = self._result, None
        return result, waited

    @property
    def last_write_seconds(self) -> float:
        return self._seconds
