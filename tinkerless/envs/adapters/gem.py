"""GEM's Gymnasium-style text envs (and any env with `reset(seed) -> (obs, info)` and a 4- or 5-tuple `step`).

    Guess = tinkerless.envs.gem("game:GuessTheNumber-v0-easy")
    tinkerless.train(env=Guess, tasks=Guess.tasks, ...)

`gem(env_id, **kwargs)` makes `gem.make(env_id, **kwargs)` per episode; `text_gym(factory)` adapts any factory
of such envs. `reset(seed)` gives the first observation; `step(text)` maps `(obs, reward, terminated,
truncated, info)` (or the older `(obs, reward, done, info)`) to a `StepResult` whose `done` is terminated or
truncated. GEM's `info["suffix"]` (what the env asks for next, e.g. "Enter your next guess.") is appended to the
observation, as GEM's own prompt wrappers do.

GEM seeds Python's and NumPy's global generators; each episode keeps its own state of both, swapped in around
every call, so episodes played side by side stay reproducible per seed. GEM's `math:*`, `code:*` and `qa:*`
ids download Hugging Face datasets and do not run offline; `game:*` and `rg:*` do.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from tinkerless.envs.adapters._optional import require
from tinkerless.envs.base import StepResult
from tinkerless.errors import ConfigError, EnvError


def gem(env_id: str, **kwargs: Any) -> type:
    """An env class over GEM's `env_id` (module docstring)."""
    require("gem")
    if not isinstance(env_id, str) or not env_id:
        raise ConfigError(f"gem takes an env id such as 'game:GuessTheNumber-v0', got {env_id!r}")
    registry = getattr(require("gem.envs.registration"), "ENV_REGISTRY", None)
    if registry is not None and env_id not in registry:
        close = sorted(i for i in registry if env_id.split(":")[-1].split("-")[0].lower() in i.lower())[:6]
        raise ConfigError(f"GEM has no env {env_id!r}", hint=f"similar ids: {close}" if close else "see gem.print_envs()")
    if env_id.split(":")[0] in ("math", "code", "qa"):
        raise ConfigError(f"GEM's {env_id} downloads a Hugging Face dataset, so it cannot run offline",
                          hint="use a game:* or rg:* env, or tinkerless.envs.reasoning_gym for Reasoning Gym tasks")
    return text_gym(_Maker(env_id, kwargs), name=env_id)


class _Maker:
    """`gem.make(env_id, **kwargs)` as a picklable factory (the module travels by name, not by value)."""

    def __init__(self, env_id: str, kwargs: dict):
        self.env_id, self.kwargs = env_id, dict(kwargs)

    def __call__(self) -> Any:
        return require("gem").make(self.env_id, **self.kwargs)


def text_gym(factory: Callable[[], Any], *, name: str | None = None) -> type:
    """An env class over `factory()`, a Gymnasium-style text env (module docstring)."""
    if not callable(factory):
        raise ConfigError(f"text_gym takes a factory of envs, got {factory!r}")
    label = name or getattr(factory, "__qualname__", "env")
    return type(f"TextGym_{''.join(c if c.isalnum() else '_' for c in label)}", (TextGymEnv,),
                {"factory": staticmethod(factory), "label": label})


def tasks(rng: random.Random) -> dict:
    return {"seed": rng.randrange(2**31)}


class TextGymEnv:
    factory: Callable[[], Any] = staticmethod(lambda: None)
    label: str = "env"
    tasks = staticmethod(tasks)

    def reset(self, seed: int | None = None) -> str:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise EnvError(f"a task's seed must be an integer, got {seed!r}")
        self._python = random.Random(seed).getstate()
        self._numpy = _numpy_state(seed)
        with self._own_random():
            self.env = type(self).factory()
            first = self.env.reset(seed=seed)
        observation, info = first if isinstance(first, tuple) and len(first) == 2 else (first, {})
        return _text(observation, info)

    def step(self, action: str) -> StepResult:
        with self._own_random():
            result = self.env.step(str(action))
        if not isinstance(result, tuple) or len(result) not in (4, 5):
            raise EnvError(f"{self.label}.step returned {type(result).__name__} of length "
                           f"{len(result) if isinstance(result, tuple) else '-'}, not (obs, reward, terminated, truncated, info)")
        if len(result) == 5:
            observation, reward, terminated, truncated, info = result
            done = bool(terminated) or bool(truncated)
        else:
            observation, reward, done, info = result
            done = bool(done)
        info = info if isinstance(info, dict) else {}
        return StepResult(observation=None if done else _text(observation, info), reward=reward, done=done,
                          info={k: v for k, v in info.items() if isinstance(v, (str, int, float, bool))})

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        outside_python = random.getstate()
        numpy = _numpy()
        outside_numpy = numpy.random.get_state() if numpy is not None else None
        random.setstate(self._python)
        if numpy is not None and self._numpy is not None:
            numpy.random.set_state(self._numpy)
        try:
            yield
        finally:
            self._python = random.getstate()
            random.setstate(outside_python)
            if numpy is not None:
                self._numpy = numpy.random.get_state()
                numpy.random.set_state(outside_numpy)


def _text(observation: Any, info: Any) -> str:
    text = observation if isinstance(observation, str) else str(observation)
    suffix = info.get("suffix") if isinstance(info, dict) else None
    return f"{text}\n{suffix}" if isinstance(suffix, str) and suffix else text


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _numpy_state(seed: int | None) -> Any:
    numpy = _numpy()
    if numpy is None:
        return None
    return numpy.random.RandomState(seed % 2**32 if seed is not None else 0).get_state()
