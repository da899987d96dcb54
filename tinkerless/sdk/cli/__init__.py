"""The `tinkerless` command: `main` (train, runs, serve, keys, ...), with `evaluate`, `export` and `sft` commands
in modules of their own. `python -m tinkerless.sdk.cli` runs it too."""

from tinkerless.sdk.cli.commands import load_config, main

__all__ = ["load_config", "main"]
