"""Task sources: a static list, a JSONL file, or a generator of dynamic tasks.

A source is indexed by a cursor (how many tasks were handed out), which is
all a checkpoint needs to continue the exact same task stream on resume.
Static data is reshuffled every epoch with a seed derived from (seed, epoch).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

from tinkerless.errors import DatasetError


class TaskSource:
    def __init__(self, tasks: Any, *, seed: int = 0, shuffle: bool = True):
        self.seed = seed
        self.shuffle = shuffle
        self._generator: Callable[[random.Random], dict] | None = None
        self._static: list[dict] | None = None
        if callable(tasks) and not isinstance(tasks, (list, tuple)):
            self._generator = tasks
            _check_task(self.task(0), "the task generator's first task")
        elif isinstance(tasks, (str, Path)):
            self._static = load_jsonl(tasks)
        elif isinstance(tasks, (list, tuple)):
            self._static = list(tasks)
            for i, task in enumerate(self._static):
                _check_task(task, f"task {i}")
        else:
            raise DatasetError(
                f"tasks must be a list of dicts, a JSONL path or a generator function, got {type(tasks).__name__}",
                hint="e.g. tasks=[{'prompt': 'What is 2+3?', 'answer': 5}] or tasks=make_task where make_task(rng) -> dict",
            )
        if self._static is not None and not self._static:
            raise DatasetError("the task dataset is empty", hint="give at least one task")

    def task(self, index: int) -> dict:
        """The task at stream position `index` (deterministic for a seed)."""
        if self._generator is not None:
            rng = random.Random(f"{self.seed}:{index}")
            try:
                task = self._generator(rng)
            except Exception as exc:
                raise DatasetError(
                    f"task generator {getattr(self._generator, '__qualname__', '')!r} raised at index {index}: {type(exc).__name__}: {exc}",
                    hint="a generator takes a random.Random and returns a dict",
                ) from exc
            return _check_task(task, f"generated task {index}")
        assert self._static is not None
        epoch, offset = divmod(index, len(self._static))
        order = list(range(len(self._static)))
        if self.shuffle:
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
        return self._static[order[offset]]

    def batch(self, cursor: int, size: int) -> tuple[list[dict], int]:
        return [self.task(cursor + i) for i in range(size)], cursor + size

    def __len__(self) -> int:
        return len(self._static) if self._static is not None else 0


def _check_task(task: Any, where: str) -> dict:
    if not isinstance(task, dict):
        raise DatasetError(f"{where} is a {type(task).__name__}, not a dict", hint="each task is a dict of fields")
    return task


def load_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"task file {path} does not exist", hint="check the path (relative to where you run)")
    tasks = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number} is not valid JSON: {exc.msg}", hint="one JSON object per line") from exc
            tasks.append(_check_task(task, f"{path}:{number}"))
    return tasks
