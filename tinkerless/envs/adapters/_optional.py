"""Importing an adapter's library, or saying which extra installs it."""

from __future__ import annotations

import importlib
from types import ModuleType

from tinkerless.errors import ConfigError

EXTRAS = {
    "reasoning_gym": ("reasoning-gym", "reasoning-gym==0.1.25"),
    "textarena": ("textarena", "textarena==0.7.4"),
    "openenv": ("openenv", "openenv-core==0.3.0"),
    "gem": ("gem", "gem-llm==0.1.0 --no-deps"),
}


def require(module: str) -> ModuleType:
    """The library's module; a ConfigError naming the tinkerless extra when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the library is there but one of its own imports is missing: that error says which
        extra, pin = EXTRAS[module.split(".")[0]]
        raise ConfigError(
            f"this env needs the {module.split('.')[0]!r} library, which is not installed",
            hint=f"pip install 'tinkerless[{extra}]' (or: pip install '{pin}')",
        ) from exc
