"""Reasoning Gym's procedural tasks and their scorers as tinkerless tasks and a reward.

    rg = tinkerless.envs.reasoning_gym("chain_sum", min_terms=2, max_terms=2)
    tinkerless.train(model="smollm2", **rg, steps=20)            # tasks=, reward=, system_prompt=

`name_or_specs` is one dataset name with its config as keyword arguments, or a weighted mixture: a list of
`(name, weight)` / `(name, weight, config)` tuples, `reasoning_gym.composite.DatasetSpec`s or dicts
(the library's composite dataset draws each task's source by weight). `curriculum=` raises the difficulty of
every task in it by one of the library's curriculum levels each time a step's mean reward reaches a threshold.

A task is the dataset's question as `prompt`, its reference `answer`, and under `reasoning_gym` the dataset
name, its full config and the item's index: the scorer rebuilds the exact item from these (datasets are
deterministic in seed and index), so tasks stay plain JSON however rich the library's metadata is.

The answer format: the system prompt asks for the final answer in `<answer>...</answer>` (the library's own
"default" prompt); the reward takes the last such tag's content (`reasoning_gym.utils.extract_answer`) and
scores it with the dataset's `score_answer`. Both can be overridden: `system_prompt=` any text (or one of
`reasoning_gym.utils.SYSTEM_PROMPTS`' names), `extract=` any `f(completion) -> str | None`.
A scorer that raises, or returns anything but a finite number, ends only that episode (an episode error
with the library's traceback in metrics.jsonl), never the run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Callable, Iterator

from tinkerless.envs.adapters._optional import require
from tinkerless.errors import ConfigError, RewardError

DEFAULT_SIZE = 10_000  # items per dataset a run draws from (some datasets build all of them up front)
DEFAULT_PROMPT = "default"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One dataset of a mixture: its registered name, its weight, its config (the library's `DatasetSpec`)."""

    name: str
    weight: float = 1.0
    config: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CurriculumPolicy:
    """Raise the difficulty one level each time a step's `reward_mean` is at least `threshold`.

    `min_steps` steps at least between two raises (the reward needs time to reflect the new level);
    `start_level` the level the run begins at. Levels are the library's own (`create_curriculum(name)`)."""

    threshold: float = 0.7
    min_steps: int = 1
    start_level: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, (int, float)) or not math.isfinite(self.threshold):
            raise ConfigError(f"curriculum threshold must be a finite number, got {self.threshold!r}")
        if not isinstance(self.min_steps, int) or self.min_steps < 1:
            raise ConfigError(f"curriculum min_steps must be a positive integer, got {self.min_steps!r}")
        if not isinstance(self.start_level, int) or self.start_level < 0:
            raise ConfigError(f"curriculum start_level must be a non-negative integer, got {self.start_level!r}")


def reasoning_gym(
    name_or_specs: Any,
    *,
    seed: int = 0,
    system_prompt: str | None = None,
    extract: Callable[[str], str | None] | None = None,
    curriculum: bool | float | CurriculumPolicy | None = None,
    **config: Any,
) -> "ReasoningGym":
    """Tasks and reward from Reasoning Gym (module docstring); `config` configures a single named dataset."""
    rg = require("reasoning_gym")
    specs = _specs(name_or_specs, config)
    known = set(require("reasoning_gym.factory").DATASETS)
    for spec in specs:
        if spec.name not in known:
            close = sorted(n for n in known if spec.name.split("_")[0] in n)[:5]
            raise ConfigError(f"Reasoning Gym has no dataset {spec.name!r}",
                              hint=f"similar names: {close}" if close else "see reasoning_gym.factory.DATASETS for the names")
    policy = _curriculum_policy(curriculum)
    prompt = _system_prompt(system_prompt, rg)
    tasks: TaskStream = CurriculumTasks(specs, seed, policy) if policy else TaskStream(specs, seed)
    tasks.check()  # a bad config fails here, on the laptop, with the library's message
    return ReasoningGym(tasks=tasks, reward=Scorer(extract), system_prompt=prompt)


class ReasoningGym(Mapping):
    """What `train()` takes: `tinkerless.train(**rg, ...)` or `TrainConfig(**rg, ...)`; also eval and SFT data."""

    def __init__(self, tasks: "TaskStream", reward: "Scorer", system_prompt: str):
        self.tasks, self.reward, self.system_prompt = tasks, reward, system_prompt

    def __getitem__(self, key: str) -> Any:
        if key not in ("tasks", "reward", "system_prompt"):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("tasks", "reward", "system_prompt"))

    def __len__(self) -> int:
        return 3

    def eval_tasks(self, count: int, seed: int = 1) -> list[dict]:
        """`count` held-out tasks (`eval_tasks=` of train, `evaluate()`), drawn with their own seed, at the start level."""
        stream = TaskStream(self.tasks.specs, self.tasks.seed + 7919 * seed)
        return [stream(random.Random(f"eval:{seed}:{i}")) for i in range(count)]

    def sft_data(self, count: int, seed: int = 2) -> list[dict]:
        """`count` chat examples `{"messages": [system, user, assistant]}` whose answer is the dataset's reference
        in the answer format (`tinkerless.sft(data=...)`); tasks without a reference answer are skipped."""
        rows = []
        for task in self.eval_tasks(count, seed=seed):
            if task.get("answer") is None:
                continue
            rows.append({"messages": [
                {"role": "system", "content": self.system_prompt},
                {"role": "user", "content": task["prompt"]},
                {"role": "assistant", "content": f"<answer>{task['answer']}</answer>"},
            ]})
        return rows


class TaskStream:
    """A task function `f(rng) -> dict` over the datasets (mixtures drawn by weight, as the library's composite)."""

    def __init__(self, specs: list[TaskSpec], seed: int):
        self.specs, self.seed = list(specs), seed

    def configs(self) -> dict[str, dict]:
        return {spec.name: dict(spec.config) for spec in self.specs}

    def __call__(self, rng: random.Random) -> dict:
        configs = self.configs()
        if len(self.specs) == 1:
            name = self.specs[0].name
        else:  # the composite's own draw: rng.choices over the unnormalized weights
            name = rng.choices([s.name for s in self.specs], weights=[s.weight for s in self.specs], k=1)[0]
        key = _key(configs[name], self.seed)
        dataset = _dataset(name, key)
        index = rng.randrange(dataset.size)
        entry = dataset[index]
        return {
            "prompt": entry["question"],
            "answer": entry.get("answer"),
            "reasoning_gym": {"dataset": name, "config": json.loads(key), "index": index},
        }

    def check(self) -> None:
        configs = self.configs()
        for spec in self.specs:
            _dataset(spec.name, _key(configs[spec.name], self.seed))[0]


class CurriculumTasks(TaskStream):
    """Tasks whose difficulty follows the run: the trainer calls `observe_step(record)` after each step
    (and replays the kept records on resume, after `restart()`), so the level is a function of the run's rewards."""

    def __init__(self, specs: list[TaskSpec], seed: int, policy: CurriculumPolicy):
        super().__init__(specs, seed)
        self.policy = policy
        factory = require("reasoning_gym.factory")
        missing = [s.name for s in specs if not factory.has_curriculum(s.name)]
        if missing:
            raise ConfigError(f"Reasoning Gym has no curriculum for {missing}",
                              hint="drop curriculum=, or use datasets listed in reasoning_gym.factory.CURRICULA")
        self.restart()

    def restart(self) -> None:
        factory = require("reasoning_gym.factory")
        self.curricula = {s.name: factory.create_curriculum(s.name) for s in self.specs}
        self.level, self.raised_at = 0, None
        for _ in range(self.policy.start_level):
            self._raise()

    def _raise(self) -> bool:
        """One level up for every task; False (levels unchanged) at the top, or where the library's own level
        config fails its dataset's validation (some curricula reach levels their config class rejects)."""
        before = {name: dict(c._current_levels) for name, c in self.curricula.items()}
        if not any([curriculum.increment_global_level() for curriculum in self.curricula.values()]):
            return False
        try:
            self.check()
        except ConfigError:
            for name, levels in before.items():
                for attribute, level in levels.items():
                    self.curricula[name].set_attr_level(attribute, level)
            return False
        self.level += 1
        return True

    def configs(self) -> dict[str, dict]:
        out = {}
        for spec in self.specs:
            # the curriculum's ranges for this level, then the user's own config on top
            curriculum = self.curricula[spec.name]
            level_config = curriculum.generate_configuration({})
            out[spec.name] = {**_plain({f: getattr(level_config, f) for f in _level_fields(curriculum)}), **spec.config}
        return out

    def observe_step(self, record: dict) -> dict:
        """After step `record["step"]`: raise the level if its reward passed the threshold; the columns to log."""
        reward, step = record.get("reward_mean"), int(record.get("step", 0))
        passed = isinstance(reward, (int, float)) and math.isfinite(reward) and reward >= self.policy.threshold
        waited = self.raised_at is None or step - self.raised_at >= self.policy.min_steps
        if passed and waited and self._raise():
            self.raised_at = step
        return {"curriculum/level": float(self.level)}


class Scorer:
    """The reward: extract the answer from the completion, score it with the dataset's own `score_answer`."""

    def __init__(self, extract: Callable[[str], str | None] | None = None):
        self.extract = extract
        self.__tinkerless_reward__ = True
        self.__qualname__ = "reasoning_gym.score_answer"

    def __call__(self, completion: Any, task: dict) -> float:
        meta = task.get("reasoning_gym") if isinstance(task, dict) else None
        if not isinstance(meta, dict) or not {"dataset", "config", "index"} <= set(meta):
            raise RewardError(f"task {str(task)[:200]!r} is not a Reasoning Gym task (no 'reasoning_gym' field)",
                              hint="use the tasks that tinkerless.envs.reasoning_gym(...) made with its reward")
        text = completion if isinstance(completion, str) else _last_assistant_text(completion)
        answer = self.extract(text) if self.extract is not None else require("reasoning_gym.utils").extract_answer(text)
        dataset = _dataset(meta["dataset"], _key(meta["config"], None))
        entry = dataset[int(meta["index"])]
        if entry["question"] != task.get("prompt"):
            raise RewardError(f"Reasoning Gym {meta['dataset']} item {meta['index']} rebuilt here is not the task's question",
                              hint="the library version differs between the client and the worker; install the same one")
        try:
            score = dataset.score_answer(answer, entry)
        except Exception as exc:  # the library's scorer raised (e.g. reasoning-gym#417): this episode's error only
            raise RewardError(
                f"Reasoning Gym's {meta['dataset']}.score_answer raised on answer {str(answer)[:200]!r}: {type(exc).__name__}: {exc}",
                hint="a bug in the library's scorer for this item; the episode is dropped, the run goes on",
            ) from exc
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise RewardError(f"Reasoning Gym's {meta['dataset']}.score_answer returned {score!r}, not a finite number")
        return float(score)


# --- helpers -------------------------------------------------------------------------------------------------


def _specs(name_or_specs: Any, config: dict) -> list[TaskSpec]:
    if isinstance(name_or_specs, str):
        if name_or_specs == "composite":
            raise ConfigError("pass the mixture itself: reasoning_gym([('chain_sum', 2.0), ('leg_counting', 1.0)])")
        return [TaskSpec(name_or_specs, 1.0, dict(config))]
    if config:
        raise ConfigError(f"config {sorted(config)} given with a mixture",
                          hint="give each dataset its own config: reasoning_gym([('chain_sum', 1.0, {'max_terms': 3}), ...])")
    if not isinstance(name_or_specs, (list, tuple)) or not name_or_specs:
        raise ConfigError(f"reasoning_gym takes a dataset name or a non-empty list of specs, got {name_or_specs!r}",
                          hint="reasoning_gym('chain_sum') or reasoning_gym([('chain_sum', 2.0), ('leg_counting', 1.0)])")
    specs = []
    for item in name_or_specs:
        if isinstance(item, str):
            spec = TaskSpec(item)
        elif isinstance(item, dict):
            spec = TaskSpec(item.get("name"), item.get("weight", 1.0), dict(item.get("config") or {}))
        elif isinstance(item, (tuple, list)) and 1 <= len(item) <= 3:
            spec = TaskSpec(*item)
        elif hasattr(item, "name") and hasattr(item, "weight"):  # the library's DatasetSpec
            spec = TaskSpec(item.name, item.weight, dict(getattr(item, "config", None) or {}))
        else:
            raise ConfigError(f"mixture entry {item!r} is not a name, (name, weight[, config]), a dict or a DatasetSpec")
        if not isinstance(spec.name, str) or isinstance(spec.weight, bool) or not isinstance(spec.weight, (int, float)) \
                or not math.isfinite(spec.weight) or spec.weight <= 0 or not isinstance(spec.config, dict):
            raise ConfigError(f"mixture entry {item!r}: needs a name, a positive finite weight and a dict config")
        specs.append(spec)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"dataset named twice in the mixture: {names}", hint="give each dataset once, with its weight")
    return specs


def _curriculum_policy(curriculum: Any) -> CurriculumPolicy | None:
    if curriculum is None or curriculum is False:
        return None
    if curriculum is True:
        return CurriculumPolicy()
    if isinstance(curriculum, CurriculumPolicy):
        return curriculum
    if isinstance(curriculum, (int, float)) and not isinstance(curriculum, bool):
        return CurriculumPolicy(threshold=float(curriculum))
    raise ConfigError(f"curriculum={curriculum!r}", hint="curriculum=True, a reward threshold (0.7) or CurriculumPolicy(...)")


def _system_prompt(system_prompt: str | None, rg: Any) -> str:
    prompts = require("reasoning_gym.utils").SYSTEM_PROMPTS
    if system_prompt is None:
        return prompts[DEFAULT_PROMPT]
    if not isinstance(system_prompt, str):
        raise ConfigError(f"system_prompt must be a string, got {type(system_prompt).__name__}")
    return prompts.get(system_prompt, system_prompt)


def _key(config: dict, seed: int | None) -> str:
    """A dataset's config as a canonical JSON string (the cache key, and what crosses to the worker)."""
    full = dict(config)
    if seed is not None:
        full.setdefault("seed", seed)
        full.setdefault("size", DEFAULT_SIZE)
    return json.dumps(_plain(full), sort_keys=True)


@lru_cache(maxsize=64)
def _dataset(name: str, key: str) -> Any:
    factory = require("reasoning_gym.factory")
    config = json.loads(key)
    try:
        return factory.create_dataset(name, **config)
    except Exception as exc:
        raise ConfigError(f"Reasoning Gym could not make {name!r} with config {config}: {type(exc).__name__}: {exc}",
                          hint=f"check the fields of {name}'s config class in reasoning_gym") from exc


def _level_fields(curriculum: Any) -> list[str]:
    """The config fields a curriculum's levels set (a range attribute sets its lower and upper field)."""
    fields = []
    for attribute in curriculum.attributes.values():
        for name in ("lower_field_name", "upper_field_name", "field_name"):
            if getattr(attribute, name, None):
                fields.append(getattr(attribute, name))
    return fields


def _plain(value: Any) -> Any:
    """JSON's view of a config (tuples become lists), so it means the same on both sides of the wire."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"Reasoning Gym config {value!r} is not plain JSON data: {exc}",
                          hint="give configs as numbers, strings, lists and dicts (tasks travel as JSON)") from exc


def _last_assistant_text(transcript: Any) -> str:
    if isinstance(transcript, list):
        for message in reversed(transcript):
            if isinstance(message, dict) and message.get("role") == "assistant":
                return str(message.get("content") or "")
    return str(transcript)
