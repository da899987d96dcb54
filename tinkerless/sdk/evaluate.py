"""`evaluate()`: run an env with a saved adapter (or the base model) and no training."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from tinkerless.envs.base import is_multi_agent
from tinkerless.errors import ConfigError, UserError
from tinkerless.sdk.backends import Backend, make_backend
from tinkerless.sdk.client import TrainingClient
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run_host import run_host_for
from tinkerless.sdk.tasks import TaskSource
from tinkerless.sdk.trainer import CLIENT_STATE_FILE
from tinkerless.sdk.transcripts import episode_record, write_transcripts
from tinkerless.wire import pack_code
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, PolicyState, RolloutRequest, SamplingParams
from tinkerless.wire.runs import CheckpointPolicy


@dataclass
class EvalReport:
    source: str
    rewards: list[float]
    errors: int
    samples: list[str] = field(default_factory=list)
    transcripts: Path | None = None  # where every episode was written, if asked for

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    def describe(self) -> str:
        lines = [f"{self.source}: mean reward {self.mean:.3f} over {len(self.rewards)} episodes ({self.errors} failed)"]
        lines += [f"  sample: {s!r}" for s in self.samples[:3]]
        if self.transcripts is not None:
            lines.append(f"  transcripts: {self.transcripts}")
        return "\n".join(lines)


def adapter_files(adapter: str) -> dict[str, bytes]:
    """A PEFT adapter directory as checkpoint-style files (adapter/<name>)."""
    directory = Path(adapter)
    if not (directory / "adapter_config.json").is_file():
        raise UserError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    return {f"adapter/{p.name}": p.read_bytes() for p in directory.iterdir() if p.is_file()}


def load_checkpoint(backend: Backend, config: TrainConfig, run_id: str, step: int | None) -> None:
    """Load run `run_id`'s checkpoint into the worker's "default" policy, from wherever the run lives
    (`storage`, or the server the backend talks to, which loads it from its own storage)."""
    host = run_host_for(backend, config.storage, config.storage_options)
    restored = host.checkpoints(run_id).restore(
        [CheckpointPolicy("default", "", "default")], [CLIENT_STATE_FILE], step, driver=False
    )
    if restored.step is None:
        raise UserError(f"run {run_id!r} has no valid checkpoint in {host.where}", hint="see `tinkerless runs`")


def evaluate(
    config: TrainConfig,
    *,
    run_id: str | None = None,
    step: int | None = None,
    adapter: str | None = None,
    episodes: int = 32,
    seed: int = 12345,
    transcripts: str | Path | None = None,
) -> EvalReport:
    """Play `episodes` episodes (one per task) with the checkpoint, adapter or base model; with
    `transcripts`, every episode goes to that JSON-lines file (format: `tinkerless.sdk.transcripts`)."""
    if config.env is not None and is_multi_agent(config.env):
        raise ConfigError(
            f"`tinkerless eval` runs single-agent envs; {config.env.__qualname__} is multi-agent",
            hint="train with the opponent you want to measure against (e.g. tinkerless.Frozen(...)) and read its win rates",
        )
    if transcripts is not None:  # a bad path fails now, not after every episode was played
        _check_writable(Path(transcripts))
    backend = make_backend(config.backend, config.model, engine=config.engine)
    policy = BASE_POLICY
    if adapter:
        TrainingClient(backend, "default", create=False).load_state(
            PolicyState("default", adapter_files(adapter)), include_optimizer=False
        )
        policy = "default"
    elif run_id is not None:
        load_checkpoint(backend, config, run_id, step)
        policy = "default"
    client = TrainingClient(backend, policy, create=False)
    tasks, _ = TaskSource(config.tasks, seed=seed).batch(0, episodes)
    limits = EpisodeLimits(max_turns=config.turn_limit(), max_episode_tokens=config.max_episode_tokens)
    result = client.rollout(
        RolloutRequest(
            policy=policy,
            tasks=tasks,
            group_size=1,
            sampling=SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p),
            limits=limits,
            seed=seed,
            env=pack_code(config.env) if config.env else None,
            reward=pack_code(config.reward) if config.reward else None,
            system_prompt=config.system_prompt,
        )
    )
    ok = [e for e in result.episodes if e.status != "error"]
    source = f"run {run_id}" + (f" step {step}" if step is not None else "") if run_id else (adapter or f"base model {config.model}")
    written = None
    if transcripts is not None:
        records = (episode_record(e, limits, step=step, task=tasks[e.task_index]) for e in result.episodes)
        written = write_transcripts(transcripts, records)
    samples = [e.transcript[-1]["content"] for e in ok]
    return EvalReport(source, [e.reward for e in ok], len(result.episodes) - len(ok), samples, written)


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise UserError(f"--transcripts {path} is a directory", hint="name a file, e.g. eval-episodes.jsonl")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write transcripts to {path}: {exc}", hint="name a file in a writable directory") from exc
