"""Adapters: environments from libraries users already have, turned into the env protocol of `envs.base`.

One module per library, each imported only when used, each library an optional extra of its own
(`pip install 'tinkerless[reasoning-gym]'`, `[textarena]`, `[openenv]`); a missing one is a `ConfigError`
that names the extra (`_optional.require`). Nothing above `envs` needs to know which library an env came from:
an adapter hands `train()` the same tasks, rewards and env classes a user would write by hand.

- `reasoning_gym`: `reasoning_gym(name_or_specs, **config)`: tasks (one task, weighted mixtures, a curriculum that
  follows the run's reward) and the library's own scorer as the reward;
- `textarena`: `textarena(env_id)`: a game's players become the seats of a multi-agent env (two or more players)
  or a single-agent env (one player), invalid moves detected as the game's rules say;
- `openenv`: `openenv(EnvironmentClass or "http://127.0.0.1:PORT")`: an OpenEnv environment in-process or over its
  WebSocket client, actions built from the model's text against the env's action schema;
- `gem`: `gem(env_id)`: GEM's Gymnasium-style text envs; `text_gym(factory)` any env with a 4- or 5-tuple `step`.

See docs/environment-libraries.md.
"""

from __future__ import annotations

from typing import Any


def reasoning_gym(name_or_specs: Any, **config: Any) -> Any:
    from tinkerless.envs.adapters.reasoning_gym import reasoning_gym as make

    return make(name_or_specs, **config)


def textarena(env_id: str, **options: Any) -> Any:
    from tinkerless.envs.adapters.textarena import textarena as make

    return make(env_id, **options)


def openenv(source: Any, **options: Any) -> Any:
    from tinkerless.envs.adapters.openenv import openenv as make

    return make(source, **options)


def gem(env_id: str, **kwargs: Any) -> Any:
    from tinkerless.envs.adapters.gem import gem as make

    return make(env_id, **kwargs)


def text_gym(factory: Any, **options: Any) -> Any:
    from tinkerless.envs.adapters.gem import text_gym as make

    return make(factory, **options)


__all__ = ["gem", "openenv", "reasoning_gym", "text_gym", "textarena"]
