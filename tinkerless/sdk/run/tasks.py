"""Task sources: a static list, a JSONL file, a task function, or a stream (generator / iterable).

A source is indexed by a cursor (how many tasks were handed out), which is
all a checkpoint needs to continue the exact same task stream on resume.
Static data is reshuffled every epoch with a seed derived from (seed, epoch).
A task function `f(rng) -> dict` gets its own `random.Random` per index. A stream
(a generator function, a generator, any iterable of dicts) is read in order and
remembered; when it ends it starts over in the same order. A generator function
that takes one argument gets a `random.Random(seed)`, so a resumed run replays it.
"""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

from tinkerless.errors import DatasetError

TASK_FORMS = (
    "tasks can be:\n"
    "  a list of dicts:      tasks=[{'prompt': 'What is 2+3?', 'answer': 5}, ...]\n"
    "  a JSONL file path:    tasks='tasks.jsonl'  (one JSON object per line)\n"
    "  a task function:      def make_task(rng): return {'prompt': ...}  (rng is a random.Random; tasks=make_task)\n"
    "  a generator function: def tasks(rng): while True: yield {'prompt': ...}  (or with no argument)\n"
    "  any iterable of dicts (a generator, a dataset)"
)


class TaskSource:
    def __init__(self, tasks: Any, *, seed: int = 0, shuffle: bool = True):
        self.seed = seed
        self.shuffle = shuffle
        self._function: Callable[[random.Random], dict] | None = None
        self._static: list[dict] | None = None
        self._stream: _Stream | None = None
        self._made: dict[int, dict] = {}  # task function results by index
        if isinstance(tasks, (str, Path)):
            self._static = load_jsonl(tasks)
        elif isinstance(tasks, (list, tuple)):
            self._static = list(tasks)
            for i, task in enumerate(self._static):
                _check_task(task, f"task {i}")
        elif isinstance(tasks, dict):
            raise DatasetError("tasks is a single dict; a run needs a collection of tasks", hint=f"wrap it in a list: tasks=[{{...}}]\n{TASK_FORMS}")
        elif inspect.isgeneratorfunction(tasks):
            self._stream = _Stream(_start_generator(tasks, seed), _name(tasks))
        elif callable(tasks):
            self._from_callable(tasks)
        elif _is_iterable(tasks):
            self._stream = _Stream(iter(tasks), type(tasks).__name__)
        else:
            raise DatasetError(f"tasks is a {type(tasks).__name__}, which is not a form of tasks", hint=TASK_FORMS)
        if self._static is not None and not self._static:
            raise DatasetError("the task dataset is empty", hint="give at least one task")
        # A source that follows the run (a curriculum): `restart()` now, `observe_step(record)` after every step.
        self.follower = tasks if callable(getattr(tasks, "observe_step", None)) else None
        if self.follower is not None and callable(getattr(self.follower, "restart", None)):
            self.follower.restart()
        self.task(0)  # the first task is checked now, before anything expensive starts

    def _from_callable(self, tasks: Callable) -> None:
        name = _name(tasks)
        parameters = _parameter_count(tasks)
        if parameters == 1:
            self._function = tasks
        elif parameters == 0:
            # A function that builds the tasks: what it returns must be a collection, not one task.
            made = _call(tasks, (), name, 0)
            if isinstance(made, dict):
                raise DatasetError(
                    f"task function {name!r} takes no argument and returns one dict",
                    hint=f"give it the rng argument, so every task can differ: def {name}(rng): ...\n{TASK_FORMS}",
                )
            if isinstance(made, (list, tuple)) or _is_iterable(made):
                self._stream = _Stream(iter(made), name)
            else:
                raise DatasetError(f"{name}() returned a {type(made).__name__}, not tasks", hint=TASK_FORMS)
        else:
            raise DatasetError(
                f"task function {name!r} takes {parameters if parameters is not None else 'an unknown number of'} "
                "arguments; a task function takes one, rng",
                hint=TASK_FORMS,
            )

    def task(self, index: int) -> dict:
        """The task at stream position `index` (deterministic for a seed)."""
        if self._function is not None:
            if index not in self._made:  # each index is made once: the checks before a run reuse what they made
                self._made[index] = self._make(index)
            return self._made[index]
        if self._stream is not None:
            return self._stream.get(index)
        assert self._static is not None
        epoch, offset = divmod(index, len(self._static))
        order = list(range(len(self._static)))
        if self.shuffle:
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
        return self._static[order[offset]]

    def _make(self, index: int) -> dict:
        assert self._function is not None
        name = _name(self._function)
        result = _call(self._function, (random.Random(f"{self.seed}:{index}"),), name, index)
        if inspect.isgenerator(result) or isinstance(result, (list, tuple)):
            raise DatasetError(
                f"task function {name!r} returned a {type(result).__name__}, not one task dict",
                hint=f"return one dict per call, or make it a generator function that yields dicts\n{TASK_FORMS}",
            )
        return _check_task(result, f"task {index} from {name!r}")

    def batch(self, cursor: int, size: int) -> tuple[list[dict], int]:
        for index in [i for i in self._made if i < cursor]:  # the cursor only moves on: keep what is still ahead
            del self._made[index]
        return [self.task(cursor + i) for i in range(size)], cursor + size

    def observe_step(self, record: dict) -> dict:
        """Tell a source that follows the run how a step went; the columns it adds to the step's record."""
        if self.follower is None:
            return {}
        columns = self.follower.observe_step(dict(record))
        if not isinstance(columns, dict):
            raise DatasetError(f"{_name(self.follower)}.observe_step returned {type(columns).__name__}, not a dict of columns")
        return columns

    def replay(self, records: list[dict]) -> None:
        """A resumed run: the follower starts over and sees the kept steps again, so it is where it was at the
        checkpoint (its state is a function of the steps' records); tasks it made before are made again."""
        if self.follower is None:
            return
        if callable(getattr(self.follower, "restart", None)):
            self.follower.restart()
        for record in records:
            self.follower.observe_step(dict(record))
        self._made.clear()

    def checked_sample(self, count: int) -> list[tuple[str, dict]]:
        """Tasks to check before a run starts: every static task, or the first `count` of a function or stream."""
        if self._static is not None:
            return [(f"task {i}", task) for i, task in enumerate(self._static)]
        return [(f"task {i}", self.task(i)) for i in range(count)]

    def __len__(self) -> int:
        return len(self._static) if self._static is not None else 0


class _Stream:
    """An iterator of tasks read on demand and remembered, so any index can be asked for again."""

    def __init__(self, iterator: Iterator, name: str):
        self.iterator, self.name = iterator, name
        self.items: list[dict] = []
        self.exhausted = False

    def get(self, index: int) -> dict:
        while len(self.items) <= index and not self.exhausted:
            position = len(self.items)
            try:
                item = next(self.iterator)
            except StopIteration:
                self.exhausted = True
                break
            except Exception as exc:
                raise DatasetError(
                    f"the tasks from {self.name!r} raised at task {position}: {type(exc).__name__}: {exc}",
                    hint="fix the generator; each item it yields is one task dict",
                ) from exc
            self.items.append(_check_task(item, f"task {position} from {self.name!r}"))
        if not self.items:
            raise DatasetError(f"{self.name!r} gave no tasks", hint="yield at least one task dict")
        return self.items[index % len(self.items)]  # a finite stream starts over in the same order


def _start_generator(function: Callable, seed: int) -> Iterator:
    count = _parameter_count(function)
    if count not in (0, 1):
        raise DatasetError(f"generator function {_name(function)!r} must take no argument or one (rng)", hint=TASK_FORMS)
    return function(random.Random(seed)) if count == 1 else function()


def _parameter_count(function: Callable) -> int | None:
    """How many positional arguments `function` is called with here: 1 if it binds one, 0 if none, else None."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return 1  # a builtin or C callable: assume the documented form f(rng)
    for count in (1, 0):
        try:
            signature.bind(*([None] * count))
            return count
        except TypeError:
            continue
    return None


def _call(function: Callable, args: tuple, name: str, index: int) -> Any:
    try:
        return function(*args)
    except DatasetError:
        raise
    except Exception as exc:
        raise DatasetError(
            f"task function {name!r} raised at task {index}: {type(exc).__name__}: {exc}",
            hint="a task function takes a random.Random and returns a dict",
        ) from exc


def _is_iterable(value: Any) -> bool:
    return hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__name__


def _check_task(task: Any, where: str) -> dict:
    if not isinstance(task, dict):
        raise DatasetError(f"{where} is a {type(task).__name__}, not a dict", hint=f"each task is a dict of fields\n{TASK_FORMS}")
    return task


def check_reset_fields(env_cls: type, source: TaskSource, count: int) -> None:
    """Every checked task must give the env's reset() each field it needs and none it does not take.

    Runs before the model loads, so a task/env mismatch is a clear error in seconds, not a run whose
    every episode fails in reset().
    """
    signature = _reset_signature(env_cls)
    if signature is None:
        return
    env_name = getattr(env_cls, "__qualname__", type(env_cls).__name__)
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = {n: p for n, p in signature.parameters.items() if p.kind in keyword_kinds}
    required = [n for n, p in named.items() if p.default is inspect.Parameter.empty]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    plain = [str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values()]
    shown = f"{env_name}.reset({', '.join(plain)})"
    for where, task in source.checked_sample(count):
        missing = [n for n in required if n not in task]
        if missing:
            raise DatasetError(
                f"{where} has no field {missing[0]!r}, which {shown} needs (the task's fields: {sorted(task)})",
                hint=f"add {missing[0]!r} to every task, or give it a default in reset(): {missing[0]}=...",
            )
        extra = [k for k in task if k not in named]
        if extra and not takes_any:
            raise DatasetError(
                f"{where} has field {extra[0]!r}, which {shown} does not take (reset is called as reset(**task))",
                hint=f"add {extra[0]!r} as a parameter of reset() (a reward can read it from the task too), "
                "or accept any field with **task",
            )


def _reset_signature(env_cls: type) -> inspect.Signature | None:
    """reset()'s signature without `self`; None when it cannot be read (then nothing is checked)."""
    static = inspect.getattr_static(env_cls, "reset", None)
    reset = getattr(env_cls, "reset", None)
    if reset is None:
        return None
    try:
        signature = inspect.signature(reset)
    except (TypeError, ValueError):
        return None
    if inspect.isfunction(static):  # a plain method read from the class: its first parameter is self
        parameters = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=parameters)
    return signature


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
