"""`modal run examples/<file>.py`: an example exposes `app = modal_entrypoint(config)`.

The same file is imported by `tinkerless train` on machines without modal, so this
module never imports modal at import time, and `modal_entrypoint` returns None
unless modal is already imported. The modal CLI imports modal before it imports
the file; `tinkerless train` never does, so it pays nothing for the line.

The entrypoint runs on the user's machine: it picks the run id, ships the config
(env, reward and task code by value) to the `Coordinator` class, which trains in
Modal with its state on the Volume, and writes the returned metrics to
``runs/<run_id>/metrics.jsonl`` locally.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from tinkerless.cloud.modal_config import ModalConfig
from tinkerless.cloud.modal_volume import VOLUME_MOUNT
from tinkerless.errors import ConfigError, UserError, rebuild_error


def modal_entrypoint(config: Any, modal_config: ModalConfig | None = None) -> Any:
    """A modal.App with a `main` local entrypoint that trains `config` on Modal, or None without modal."""
    if "modal" not in sys.modules:
        return None
    from tinkerless.cloud.modal_app import build_app

    settings = modal_config if modal_config is not None else ModalConfig.from_env()
    built = build_app(settings)

    def main(run_id: str = "", steps: int = 0) -> None:
        """Train on Modal; `--run-id ID` resumes (or names) a run, `--steps N` overrides the step count."""
        run_on_modal(config.replace(steps=steps) if steps else config, built.classes, settings, run_id=run_id or None)

    main.__qualname__ = "main"  # Modal accepts only entrypoints that look module-level
    built.app.local_entrypoint(name="main")(main)
    return built.app


def run_on_modal(config: Any, classes: dict, settings: ModalConfig, *, run_id: str | None = None) -> dict:
    """Run `config` in the Coordinator class (inside a running App) and keep a local copy of its metrics."""
    from tinkerless.sdk.run.metrics import MetricsWriter, plot_metrics

    config.validate()
    from tinkerless.cloud.preflight import check_modal

    # Before the coordinator starts (and bills): every GPU role can hold the model (docs/scaling.md).
    check_modal(config.model, settings, engine=config.engine, dtype=config.dtype, lora_rank=config.lora_rank,
                tokens=min(config.max_episode_tokens, config.max_tokens * config.turn_limit()))
    # Trackers log from here, after the run, from the metrics it returns: no tracker credentials go to Modal.
    shipped = ship_config(config.replace(report_to=[]))
    # The id is fixed here, before the call, so a retried coordinator resumes this run instead of starting another.
    run_id = run_id or f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}-{random.randrange(16**4):04x}"
    from tinkerless.sdk.run.estimate import before_launch

    print(f"run {run_id}: training on Modal\n{settings.describe()}\n{before_launch(config, settings.update.gpu)}",
          flush=True)  # what it will cost, before anything is spent
    result = classes["coordinator"](volume=settings.volume_name).train.remote(shipped, run_id, settings.to_json())
    if "error" in result:  # a user error in the container, raised here with its type and hint
        error = result["error"]
        message = f"run {run_id} on Modal: {error['message']}"
        raise (rebuild_error(error["type"], message, hint=error["hint"], cause=error.get("cause"))
               or UserError(message, hint=error["hint"]))
    local = Path("runs") / run_id
    local.mkdir(parents=True, exist_ok=True)
    metrics = local / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    writer = MetricsWriter(metrics)
    for record in result["metrics"]:
        writer.log(record)
    plot = plot_metrics(metrics, local / "metrics.png", title=run_id) if result["metrics"] else None
    remote_dir = result["run_dir"]
    if remote_dir.startswith(VOLUME_MOUNT + "/"):  # `volume get` writes a folder into an existing local folder
        where = remote_dir[len(VOLUME_MOUNT) + 1 :]
        fetch = f"modal volume get {settings.volume_name} {where}/checkpoints runs/{run_id}"
    else:
        fetch = f"{result['storage']}/runs/{run_id}/checkpoints"
    from tinkerless.sdk.run.accounting import seconds_total

    usage = result.get("usage") or {}
    cost = usage.get("cost_usd")
    from tinkerless.sdk.run.metrics import reward_summary
    from tinkerless.sdk.tracking.runs import report_modal_run

    report_modal_run(config.report_to, config=config, run_id=run_id, run_dir=local, records=result["metrics"],
                     summary={**reward_summary(result["metrics"]), "usage": usage}, plot=plot and Path(plot))
    print(
        f"run {run_id} {'resumed and ' if result['resumed'] else ''}finished on Modal; last checkpoint "
        f"step-{result['last_checkpoint_step']}\n  metrics: {metrics}\n"
        f"  compute: {seconds_total(usage):.1f} GPU-seconds on {usage.get('device') or 'Modal'}"
        f"{f', about ${cost:.2f}' if cost is not None else ''}\n"
        f"  checkpoints: {fetch}\n"
        f"  resume or extend: modal run <this file> --run-id {run_id} [--steps N]",
        flush=True,
    )
    return result


def ship_config(config: Any) -> Any:
    """The config as a CodeBlob, with the user's own modules pickled by value and task files read here."""
    from tinkerless.sdk.run.agents import frozen_adapters
    from tinkerless.sdk.run.tasks import load_jsonl
    from tinkerless.wire import pack_code
    from tinkerless.wire.code import _register_user_module

    if isinstance(config.tasks, (str, Path)):  # the coordinator has no copy of the client's files
        config = config.replace(tasks=load_jsonl(config.tasks))
    if config.env is not None and config.agents is not None:
        local = [p for p in frozen_adapters(config.agents) if not str(p).startswith(VOLUME_MOUNT + "/")]
        if local:
            raise ConfigError(
                f"frozen adapter directories {local} are on this machine, not on the Modal Volume",
                hint=f"upload one with `modal volume put <volume> {local[0]} frozen/<name>` and use "
                f"tinkerless.Frozen('{VOLUME_MOUNT}/frozen/<name>')",
            )
    for value in _user_code(config):
        _register_user_module(value)
    return pack_code(config, name=f"TrainConfig {config.name!r}")


def _user_code(config: Any) -> list[Any]:
    """Every callable or class the user put into the config (env, reward, task generator, opponents)."""
    found: list[Any] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif callable(value):
            found.append(value)

    for value in (config.env, config.reward, config.tasks, config.agents):
        walk(value)
    return found
