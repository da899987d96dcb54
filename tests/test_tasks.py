"""Every accepted form of `tasks`, the error for anything else, and the reset() field check before the model loads."""

from __future__ import annotations

import itertools
import random

import pytest

import tinkerless
from tinkerless.errors import DatasetError
from tinkerless.sdk.run.tasks import TaskSource, check_reset_fields


def _first(source: TaskSource, n: int) -> list[dict]:
    return source.batch(0, n)[0]


def make_task(rng: random.Random) -> dict:
    return {"prompt": f"add {rng.randint(0, 9)}"}


def test_task_function_gets_an_rng_per_index_and_is_reproducible():
    a, b = TaskSource(make_task, seed=3), TaskSource(make_task, seed=3)
    assert _first(a, 8) == _first(b, 8)
    assert a.task(5) == a.task(5)  # any index, any order: what resume relies on
    assert _first(TaskSource(make_task, seed=4), 8) != _first(a, 8)


def test_generator_function_with_rng_is_replayed_on_resume():
    def tasks(rng):
        while True:
            yield {"prompt": f"guess {rng.randint(0, 99)}"}

    first = TaskSource(tasks, seed=1)
    stream = _first(first, 10)
    resumed = TaskSource(tasks, seed=1)  # a new process: the cursor says where to go on
    assert resumed.batch(6, 4)[0] == stream[6:]
    assert first.task(2) == stream[2]  # earlier tasks are remembered


def test_generator_function_without_arguments():
    def tasks():
        for n in itertools.count():
            yield {"prompt": f"count to {n}"}

    assert [t["prompt"] for t in _first(TaskSource(tasks), 3)] == ["count to 0", "count to 1", "count to 2"]


def test_a_finite_generator_starts_over_in_order():
    def two():
        yield {"prompt": "a"}
        yield {"prompt": "b"}

    assert [t["prompt"] for t in _first(TaskSource(two), 5)] == ["a", "b", "a", "b", "a"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: ({"prompt": p} for p in "xyz"),  # a generator object
        lambda: iter([{"prompt": p} for p in "xyz"]),  # an iterator
        lambda: map(lambda p: {"prompt": p}, "xyz"),  # any iterable
    ],
    ids=["generator", "iterator", "map"],
)
def test_iterables_of_dicts(make):
    assert [t["prompt"] for t in _first(TaskSource(make()), 4)] == ["x", "y", "z", "x"]


def test_a_function_that_returns_the_task_list():
    assert [t["prompt"] for t in _first(TaskSource(lambda: [{"prompt": "p"}, {"prompt": "q"}]), 3)] == ["p", "q", "p"]


def test_list_and_jsonl_still_work(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert sorted(t["prompt"] for t in _first(TaskSource(str(path)), 2)) == ["a", "b"]
    assert sorted(t["prompt"] for t in _first(TaskSource([{"prompt": "a"}, {"prompt": "b"}]), 2)) == ["a", "b"]


@pytest.mark.parametrize(
    "tasks, says",
    [
        (42, "tasks is a int"),
        ({"prompt": "one"}, "single dict"),
        (lambda: {"prompt": "one"}, "takes no argument and returns one dict"),
        (lambda rng, other: {"prompt": "x"}, "a task function takes one, rng"),
        (lambda rng: ({"prompt": "x"} for _ in range(2)), "returned a generator, not one task dict"),
        (lambda rng: "prompt", "is a str, not a dict"),
        (({"prompt": "x"}, "oops"), "task 1 is a str"),
        ((x for x in [1, 2]), "task 0 from 'generator' is a int"),
        ((x for x in []), "gave no tasks"),
        ([], "empty"),
    ],
    ids=["int", "dict", "no-rng", "two-args", "returns-generator", "returns-str", "tuple-bad-item", "yields-int",
         "empty-generator", "empty-list"],
)
def test_anything_else_is_a_dataset_error_that_shows_the_forms(tasks, says):
    with pytest.raises(DatasetError, match=says) as info:
        TaskSource(tasks)
    assert info.value.category == "user"


def test_the_error_shows_the_right_forms():
    with pytest.raises(DatasetError) as info:
        TaskSource(3.5)
    assert "def make_task(rng): return {" in info.value.hint and "yield" in info.value.hint


def test_a_generator_that_raises_names_the_task():
    def tasks():
        yield {"prompt": "ok"}
        raise KeyError("level")

    source = TaskSource(tasks)
    with pytest.raises(DatasetError, match="raised at task 1: KeyError"):
        source.batch(0, 2)


# ---- reset() fields ------------------------------------------------------------------------------------------------


@tinkerless.env
class NeedsTarget:
    def reset(self, target: int, hint: str = "") -> str:
        self.target = target
        return "guess"

    def step(self, action: str) -> tinkerless.StepResult:
        return tinkerless.StepResult(reward=0.0, done=True)


@tinkerless.env
class TakesAnything:
    def reset(self, **task) -> str:
        return "go"

    def step(self, action: str) -> tinkerless.StepResult:
        return tinkerless.StepResult(done=True)


def test_reset_field_check_accepts_matching_tasks():
    check_reset_fields(NeedsTarget, TaskSource([{"target": 3}, {"target": 4, "hint": "low"}]), count=2)
    check_reset_fields(TakesAnything, TaskSource([{"anything": 1}]), count=1)


def test_a_missing_field_names_the_field_and_the_task():
    source = TaskSource([{"target": 3}, {"goal": 4}])
    with pytest.raises(DatasetError) as info:
        check_reset_fields(NeedsTarget, source, count=2)
    message = info.value.message
    assert "task 1 has no field 'target'" in message and "NeedsTarget.reset(target, hint='')" in message
    assert "['goal']" in message and "add 'target' to every task" in info.value.hint


def test_a_field_reset_does_not_take_is_named():
    with pytest.raises(DatasetError, match="task 0 has field 'answer', which NeedsTarget.reset"):
        check_reset_fields(NeedsTarget, TaskSource([{"target": 1, "answer": 2}]), count=1)


def test_generated_tasks_are_checked_too():
    with pytest.raises(DatasetError, match="task 0 has no field 'target'"):
        check_reset_fields(NeedsTarget, TaskSource(lambda rng: {"goal": rng.random()}), count=4)


def test_train_refuses_a_task_reset_cannot_take_before_loading_the_model(tmp_path, monkeypatch):
    import tinkerless.sdk.run.trainer as trainer

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load before the task check")

    monkeypatch.setattr(trainer, "make_backend", no_model)
    with pytest.raises(DatasetError, match="task 0 has no field 'target'"):
        tinkerless.train(env=NeedsTarget, tasks=[{"goal": 1}], steps=1, storage=str(tmp_path), progress=False)


def test_the_check_before_the_run_reuses_the_tasks_it_made():
    calls = []

    def counted(rng):
        calls.append(1)
        return {"target": rng.randint(0, 9)}

    source = TaskSource(counted)
    check_reset_fields(NeedsTarget, source, count=4)
    assert source.batch(0, 4)[0] == source.batch(0, 4)[0] and len(calls) == 4  # each index made once
    source.batch(4, 2)
    assert len(calls) == 6
