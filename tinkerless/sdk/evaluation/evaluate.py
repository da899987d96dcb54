"""`evaluate()`: play an env's own episodes with a saved adapter (or the base model), no training.

The episodes come from the training agent loop itself: a `RolloutRequest` built as `train()` builds
one (`rollout_request`), run by the worker's `rollout` on whatever backend the config names. So a
checkpoint evaluated with the tasks, group size and seed of a training step plays exactly that
step's episodes, token for token.

Each task is played `samples` times (default: the config's group_size); the report gives the mean
reward, pass@k for k in {1, group_size} with the unbiased estimator (`pass_at_k`), and throughput.
"""

from __future__ import annotations

import math
import secrets
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinkerless.envs.base import is_multi_agent
from tinkerless.errors import ConfigError, DatasetError, StorageNotFound, TinkerlessError, UserError
from tinkerless.sdk.backends.base import Backend, make_backend
from tinkerless.sdk.checkpoints.checkpoint_ref import CheckpointRef, check_base_model, find_run, parse_checkpoint
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.evaluation.pass_at_k import PassRule, mean_pass_at_k
from tinkerless.sdk.backends.run_host import run_host_for
from tinkerless.sdk.run.tasks import TaskSource, check_reset_fields
from tinkerless.sdk.run import infra_failures
from tinkerless.sdk.run.transcripts import episode_record, write_transcripts
from tinkerless.sdk.tracking.base import check_report_to, tracker_names
from tinkerless.wire import pack_code
from tinkerless.wire.validate import MAX_SEED
from tinkerless.wire.messages import BASE_POLICY, Episode, PolicyState, RolloutRequest
from tinkerless.wire.runs import CheckpointPolicy

if TYPE_CHECKING:
    from tinkerless.sdk.evaluation.games import GamesReport

# Episodes per rollout call: a `tinkerless serve` server refuses more by default (ServingLimits.max_rollouts),
# and a training step's rollout is held to the same limit. A larger eval is played in several calls.
MAX_EPISODES_PER_ROLLOUT = 512
# Tasks drawn from a task function or stream when no count is given: with group_size 4, the 32 episodes
# the older `--episodes` default played.
DEFAULT_GENERATED_TASKS = 8


@dataclass
class EvalReport:
    source: str
    rewards: list[float]  # of the episodes that did not fail
    errors: int
    samples: list[str] = field(default_factory=list)  # a few final assistant messages
    transcripts: Path | None = None  # where every episode was written, if asked for
    num_tasks: int = 0
    samples_per_task: int = 1
    pass_at: dict[int, float] = field(default_factory=dict)  # k -> mean pass@k over tasks
    pass_rule: str = PassRule().describe()
    seconds: float = 0.0  # wall time of the rollout call
    sampled_tokens: int = 0
    step: int | None = None  # the checkpoint step that was loaded (resolved for @latest)
    played: list[Episode] = field(default_factory=list, repr=False)  # every episode, as the rollout returned it

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    @property
    def episodes(self) -> int:
        return len(self.rewards) + self.errors

    @property
    def episodes_per_second(self) -> float:
        return self.episodes / self.seconds if self.seconds > 0 else math.nan

    def describe(self) -> str:
        lines = [f"{self.source}: mean reward {self.mean:.3f} over {self.episodes} episodes ({self.errors} failed)"]
        if self.pass_at:
            passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in sorted(self.pass_at.items()))
            lines.append(f"  {passes} ({self.num_tasks} tasks x {self.samples_per_task} samples; pass: {self.pass_rule})")
        lines.append(
            f"  {self.episodes_per_second:.2f} episodes/s, {self.sampled_tokens} sampled tokens in {self.seconds:.1f}s"
        )
        lines += [f"  sample: {s!r}" for s in self.samples[:3]]
        if self.transcripts is not None:
            lines.append(f"  transcripts: {self.transcripts}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report as plain data (`tinkerless eval --json`)."""
        return {
            "source": self.source, "step": self.step, "reward_mean": self.mean, "episodes": self.episodes,
            "errors": self.errors, "tasks": self.num_tasks, "samples_per_task": self.samples_per_task,
            "pass_at": {str(k): v for k, v in sorted(self.pass_at.items())}, "pass_rule": self.pass_rule,
            "seconds": self.seconds, "episodes_per_s": self.episodes_per_second, "sampled_tokens": self.sampled_tokens,
            "transcripts": None if self.transcripts is None else str(self.transcripts),
        }


def adapter_files(adapter: str) -> dict[str, bytes]:
    """A PEFT adapter directory as checkpoint-style files (adapter/<name>)."""
    directory = Path(adapter)
    if not (directory / "adapter_config.json").is_file():
        raise UserError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    return {f"adapter/{p.name}": p.read_bytes() for p in directory.iterdir() if p.is_file()}


def load_checkpoint(
    backend: Backend, config: TrainConfig, run_id: str, step: int | None, policy: str = "default"
) -> int:
    """Load run `run_id`'s checkpoint `step` (None: its latest valid one) into the worker's `policy`,
    from wherever the run lives (`storage`, or the server the backend talks to, which loads it
    from its own storage). Returns the step loaded. The run must have trained `config.model`."""
    host = run_host_for(backend, config.storage, config.storage_options)
    state = find_run(host, run_id)
    check_base_model(state, config.model, f"run {run_id!r}")
    from tinkerless.sdk.run.trainer import CLIENT_STATE_FILE  # the trainer imports this module

    restored = host.checkpoints(run_id).restore(
        [CheckpointPolicy("default", "", policy)], [CLIENT_STATE_FILE], step, driver=False
    )
    if restored.step is None:
        raise UserError(f"run {run_id!r} has no valid checkpoint in {host.where}", hint="see `tinkerless runs`")
    return restored.step


def choose_tasks(config: TrainConfig, tasks: Any = None, num_tasks: int | None = None) -> list[dict]:
    """The tasks to evaluate on: `tasks`, else the config's held-out `eval_tasks`, else its `tasks`; in their
    order (a list or JSONL file: all of it unless `num_tasks` says how many; a function or stream: the first
    `num_tasks`, default 8)."""
    source_tasks = next((t for t in (tasks, config.eval_tasks, config.tasks) if t is not None), None)
    if source_tasks is None:
        raise ConfigError("there are no tasks to evaluate on", hint="give the config tasks= (or eval_tasks=)")
    if num_tasks is not None and (isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 1):
        raise ConfigError(f"the number of eval tasks must be a whole number >= 1, got {num_tasks!r}")
    source = TaskSource(source_tasks, seed=config.seed, shuffle=False)
    count = num_tasks or (len(source) or DEFAULT_GENERATED_TASKS)
    if config.env is not None:
        check_reset_fields(config.env, source, count=min(count, 8))
    return source.batch(0, count)[0]


def held_out_tasks(config: TrainConfig) -> list[dict]:
    """The tasks `eval_every` plays: the config's `eval_tasks`, all of a list (8 of a task function)."""
    try:
        return choose_tasks(config, config.eval_tasks)
    except DatasetError as exc:  # say which of the config's task sets is wrong
        raise DatasetError(f"eval_tasks: {exc.message}", hint=exc.hint) from None


def eval_columns(report: "EvalReport") -> dict:
    """An eval's metrics.jsonl columns, next to the training step's own."""
    columns = {"eval_reward_mean": report.mean, "eval_episodes": report.episodes, "eval_errors": report.errors,
               "eval_s": report.seconds}
    columns.update({f"eval_pass@{k}": v for k, v in sorted(report.pass_at.items())})
    return columns


def rollout_request(config: TrainConfig, policy: str, tasks: list[dict], group_size: int, seed: int) -> RolloutRequest:
    """The rollout `train()` sends for these tasks, group size and seed: the same fields from the same config
    (`tests/test_eval.py` replays a training step from its checkpoint token for token, so they cannot drift)."""
    from tinkerless.sdk.run.judging import split_reward

    env = pack_code(config.env, name=getattr(config.env, "__qualname__", None)) if config.env else None
    code, judge = split_reward(config.reward)  # code rewards as one function, a judge beside them (as in train)
    reward = pack_code(code, name=getattr(code, "__qualname__", None)) if code else None
    return RolloutRequest(
        policy=policy,
        tasks=tasks,
        group_size=group_size,
        sampling=config.sampling_params(),
        limits=config.episode_limits(),
        seed=seed,
        env=env,
        reward=reward,
        system_prompt=config.system_prompt,
        judge=judge,
    )


def play(
    client: TrainingClient, config: TrainConfig, tasks: list[dict], *, samples: int, seed: int, policy: str = "default",
    rule: PassRule | None = None, source: str = "",
) -> EvalReport:
    """Play every task `samples` times with `client`'s policy (`policy` "base": no adapter); no training."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"samples per task must be a whole number >= 1, got {samples!r}")
    rule = rule or PassRule()
    started = time.perf_counter()
    episodes = []
    per_call = max(1, MAX_EPISODES_PER_ROLLOUT // samples)  # tasks per rollout call
    for first in range(0, len(tasks), per_call):
        # The first call keeps `seed` (a training step's rollout fits in one call, so eval replays it exactly);
        # later calls get seeds of their own, so no two calls sample with the same random streams.
        call_seed = seed if first == 0 else (seed * 1_000_003 + first) % MAX_SEED
        # An episode whose env server, judge or sandbox failed is played again (sdk/run/infra_failures.py); one that
        # still fails counts as an error, never as a reward.
        result = infra_failures.play(client.rollout, rollout_request(config, policy, tasks[first:first + per_call], samples,
                                                                     call_seed), config.infra_retries)
        for episode in result.episodes:
            episode.task_index += first
        episodes.extend(result.episodes)
    seconds = time.perf_counter() - started
    ok = [e for e in episodes if e.status not in ("error", infra_failures.INFRA_FAILED)]
    passed = [0] * len(tasks)
    for episode in episodes:
        if 0 <= episode.task_index < len(tasks) and rule.passed(episode.reward, episode.status in ("error", infra_failures.INFRA_FAILED)):
            passed[episode.task_index] += 1
    ks = sorted(k for k in {1, config.group_size} if k <= samples)
    return EvalReport(
        source=source,
        rewards=[e.reward for e in ok],
        errors=len(episodes) - len(ok),
        samples=[e.transcript[-1]["content"] for e in ok if e.transcript],
        num_tasks=len(tasks),
        samples_per_task=samples,
        pass_at={k: mean_pass_at_k(((samples, c) for c in passed), k) for k in ks},
        pass_rule=rule.describe(),
        seconds=seconds,
        sampled_tokens=sum(e.sampled_tokens() for e in episodes),
        played=episodes,
    )


def evaluate(
    config: TrainConfig,
    *,
    checkpoint: str | CheckpointRef | None = None,
    run_id: str | None = None,
    step: int | None = None,
    adapter: str | None = None,
    tasks: Any = None,
    num_tasks: int | None = None,
    samples: int | None = None,
    episodes: int | None = None,
    seed: int = 12345,
    pass_threshold: float | None = None,
    transcripts: str | Path | None = None,
) -> "EvalReport | GamesReport":
    """Evaluate a checkpoint (`checkpoint="run@step"`, `"run@latest"`, `"base"`; or `run_id`/`step`), a PEFT
    `adapter` directory, or the base model on the env's own episodes, with no training.

    Each of the eval tasks (`eval_tasks`) is played `samples` times (default: config.group_size);
    `episodes=N` is the older form: N tasks, one sample each. With `transcripts`, every episode goes to
    that JSON-lines file (format: `tinkerless.sdk.run.transcripts`, plus whether it `passed`). A multi-agent env
    plays its eval seatings instead (`eval_agents`, else `agents`) and returns each policy's win, draw and loss
    rates in a `games.GamesReport`."""
    ref = _which_checkpoint(checkpoint, run_id, step, adapter)
    check_report_to(config.report_to)  # a tracker that is not installed fails before any model loads
    if episodes is not None:
        if num_tasks is not None or samples is not None:
            raise ConfigError("episodes= is the older form of num_tasks= with samples=1; give one or the other")
        num_tasks, samples = episodes, 1
    samples = config.group_size if samples is None else samples
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:  # before any model loads
        raise ConfigError(f"samples per task must be a whole number >= 1, got {samples!r}", hint="e.g. --samples 4")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be a whole number from 0 to 2**63-1, got {seed!r}", hint="e.g. --seed 12345")
    if config.env is not None and is_multi_agent(config.env):  # games: win rates per policy (evaluation/games.py)
        if pass_threshold is not None or transcripts is not None:
            raise ConfigError("pass thresholds and transcripts are for single-agent evals",
                              hint="a multi-agent eval reports each policy's win, draw and loss rates")
        from tinkerless.sdk.evaluation.games import evaluate_games

        return evaluate_games(config, ref=ref, adapter=adapter, tasks=choose_tasks(config, tasks, num_tasks),
                              samples=samples, seed=seed, source=_source(config, ref, adapter))
    rule = PassRule(pass_threshold)
    if transcripts is not None:  # a bad path fails now, not after every episode was played
        _check_writable(Path(transcripts))
    chosen = choose_tasks(config, tasks, num_tasks)
    # What can be checked without the model is checked before it loads: the adapter's files, the run.
    files = adapter_files(adapter) if adapter is not None else None
    if ref is not None and not ref.is_base and config.backend in ("local", "modal"):
        _check_run_in_storage(config, ref)
    backend = eval_backend(config)
    # A policy of this evaluation's own: two evaluations by one tenant on a server never load into the same
    # adapter (with one shared name, the second's load would change the weights under the first's episodes).
    own = f"eval-{secrets.token_hex(6)}"
    policy, loaded = BASE_POLICY, None
    try:
        if files is not None:
            TrainingClient(backend, own, create=False).load_state(PolicyState(own, files), include_optimizer=False)
            policy = own
        elif ref is not None and not ref.is_base:
            policy = own  # set first: a load that fails half-way is freed below too
            loaded = load_checkpoint(backend, config, ref.run_id, ref.step, policy=own)
        client = TrainingClient(backend, policy, create=False)
        report = play(client, config, chosen, samples=samples, seed=seed, policy=policy, rule=rule,
                      source=_source(config, ref, adapter))
    finally:
        try:
            if policy == own:  # a server keeps what it is not told to free
                TrainingClient(backend, own, create=False).delete()
        except TinkerlessError as exc:  # cleanup only: the evaluation's own outcome (or error) is what matters
            warnings.warn(f"could not free this evaluation's policy {own} on the worker: {exc}", stacklevel=2)
        finally:
            backend.close()
    report.step = loaded
    if transcripts is not None:
        limits = config.episode_limits()
        records = (
            {**episode_record(e, limits, step=loaded, task=chosen[e.task_index]),
             "passed": rule.passed(e.reward, e.status in ("error", infra_failures.INFRA_FAILED))}
            for e in report.played
        )
        report.transcripts = write_transcripts(transcripts, records)
    if tracker_names(config.report_to):  # logged from here, like a training run's (docs/tracking.md)
        from tinkerless.sdk.tracking.runs import report_eval

        where = adapter or (None if ref is None or ref.is_base else str(ref))
        report_eval(config, report, chosen, checkpoint=where, samples=samples, seed=seed)
    return report


def load_adapter_dirs(backend: Backend, adapters: dict[str, str], namespace: str = "") -> None:
    """Each PEFT adapter directory (path -> the worker policy it plays as) loaded to be played, not trained."""
    for path, name in adapters.items():
        TrainingClient(backend, name, create=False, namespace=namespace).load_state(
            PolicyState(name, adapter_files(path)), include_optimizer=False)


def eval_backend(config: TrainConfig) -> Backend:
    """The backend an evaluation plays on: the config's, with its CPU threads on the local one."""
    threads = {"threads": config.threads} if config.backend == "local" and config.threads else {}
    return make_backend(config.backend, config.model, engine=config.engine, **threads)


def _which_checkpoint(checkpoint, run_id: str | None, step: int | None, adapter: str | None) -> CheckpointRef | None:
    given = [name for name, value in (("checkpoint", checkpoint), ("run_id", run_id), ("adapter", adapter)) if value is not None]
    if len(given) > 1:
        raise ConfigError(f"give one of {' / '.join(given)}, not several", hint="e.g. checkpoint='my-run@latest'")
    if step is not None and run_id is None:
        raise ConfigError("step= needs run_id= (or write checkpoint='RUN_ID@STEP')")
    if checkpoint is not None:
        return checkpoint if isinstance(checkpoint, CheckpointRef) else parse_checkpoint(checkpoint)
    if run_id is None:
        return None
    return parse_checkpoint(f"{run_id}@{'latest' if step is None else step}")  # the same checks as --checkpoint


def _check_run_in_storage(config: TrainConfig, ref: CheckpointRef) -> None:
    """The run exists in `storage`, trained `config.model`, and has the step asked for."""
    from tinkerless.coordinator import checkpoint_prefix
    from tinkerless.sdk.backends.run_host import StorageRunHost
    from tinkerless.storage import CheckpointStore, ObjectStore

    host = StorageRunHost(ObjectStore(config.storage, **(config.storage_options or {})), backend=None)
    check_base_model(find_run(host, ref.run_id), config.model, f"run {ref.run_id!r}")
    steps = CheckpointStore(host.store, checkpoint_prefix(ref.run_id)).steps()
    if ref.step is not None and ref.step not in steps:
        raise StorageNotFound(
            f"no checkpoint for step {ref.step} of run {ref.run_id!r} in {host.where}; available steps: {steps}",
            hint=f"pick one of them, e.g. --checkpoint {ref.run_id}@{steps[-1]}" if steps else "this run has no checkpoint yet",
        )


def _source(config: TrainConfig, ref: CheckpointRef | None, adapter: str | None) -> str:
    if adapter is not None:
        return str(adapter)
    if ref is None or ref.is_base:
        return f"base model {config.model}"
    return f"run {ref.run_id}" + (f" step {ref.step}" if ref.step is not None else "")


def _check_writable(path: Path) -> None:
    if path.is_dir():
        raise UserError(f"--transcripts {path} is a directory", hint="name a file, e.g. eval-episodes.jsonl")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write transcripts to {path}: {exc}", hint="name a file in a writable directory") from exc
