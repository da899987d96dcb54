"""Held-out games for multi-agent runs: the seatings of `eval_agents` play the held-out tasks, nothing trains.

    config = TrainConfig(env=TicTacToe, agents=tinkerless.self_play(TicTacToe.agents, policy="player"),
                         eval_every=5, eval_tasks=[{"seed": s} for s in range(8)],
                         eval_agents=[tinkerless.versus(role, random_opponent, roles=TicTacToe.agents, policy="player")
                                      for role in TicTacToe.agents])

`eval_every` on a multi-agent run plays every seating of `eval_agents` (default: the run's own `agents`) on
`eval_tasks`, each task `group_size` times, with the policies as they are at that step, and logs for each of the
run's policies its mean reward and its win, draw and loss rates over finished games (`eval_reward_mean/<policy>`,
`eval_win_rate/<policy>`, ...). Self-play against itself always "wins" half its games, so a win rate that says
something needs another seat: a scripted opponent, `Frozen()` (the base model) or a frozen checkpoint.

The games are seeded by the run's seed alone, not its step, so every eval of a run meets the same openings and,
for a scripted opponent, the same draws of its generator: the curve moves with the policy only.

`evaluate()` (and `tinkerless eval`) of a multi-agent env plays the same games after a run (`evaluate_games`): a
checkpoint's policies (each loaded under a name of the evaluation's own), a PEFT adapter for a run's one policy, or
the base model in every policy's seat, and returns the same columns in a `GamesReport`.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from dataclasses import dataclass
from typing import Any, Callable

from tinkerless.errors import ConfigError, UserError
from tinkerless.sdk.run.agents import every_frozen_adapter, seatings, trainable_policies
from tinkerless.sdk.run.multi_agent import build_seats
from tinkerless.sdk.run.step_metrics import agent_metrics
from tinkerless.wire import pack_code
from tinkerless.wire.messages import BASE_POLICY, MultiAgentRolloutRequest, PolicyState

EVAL_SEED_OFFSET = 7_919  # held-out games draw apart from every training step's seeds (step_seed(seed, step) + index)


def eval_seatings(config: Any) -> list[dict]:
    """The seatings a held-out eval plays: `eval_agents`, else the run's `agents`."""
    return seatings(config.eval_agents if config.eval_agents is not None else config.agents)


def play_games(rollout_multi: Callable[[MultiAgentRolloutRequest], Any], config: Any, tasks: list[dict], *,
               policies: list[str], frozen: dict[str, str], names: dict[str, str] | None = None,
               played: list | None = None) -> dict[str, float]:
    """Play every eval seating on `tasks` (no seat trains); the `eval_*` columns of the run's policies.

    `frozen` maps each frozen adapter path to the worker policy it is loaded as (the run loads every path that
    `agents` or `eval_agents` seats, `agents.frozen_adapters`); `names`, each run policy to the worker policy that
    plays it (default: its own name); `played`, where every episode goes, if given."""
    names = names or {}
    run_name = {worker: policy for policy, worker in names.items()}
    started = time.perf_counter()
    env = pack_code(config.env, name=getattr(config.env, "__qualname__", None))
    episodes = []
    for index, seats in enumerate(build_seats(eval_seatings(config), frozen)):
        held = {role: dataclasses.replace(seat, trainable=False, policy=names.get(seat.policy, seat.policy))
                for role, seat in seats.items()}
        result = rollout_multi(MultiAgentRolloutRequest(
            tasks=tasks, group_size=config.group_size, env=env, seats=held, sampling=config.sampling_params(), limits=config.episode_limits(),
            seed=config.seed + EVAL_SEED_OFFSET + index, protocol_timeout=config.protocol_timeout,
        ))
        for episode in result.episodes:
            episode.info["policy"] = run_name.get(episode.info.get("policy"), episode.info.get("policy"))
        episodes.extend(result.episodes)
    if played is not None:
        played.extend(episodes)
    columns = {f"eval_{key}": value for key, value in agent_metrics(episodes, policies).items()}
    own = [e for e in episodes if e.info.get("policy") in policies]
    columns.update({"eval_episodes": len(own), "eval_errors": sum(e.status == "error" for e in own),
                    "eval_s": time.perf_counter() - started})
    return columns


@dataclass
class GamesReport:
    """`evaluate()` of a multi-agent env: the columns `eval_every` logs, for a checkpoint, an adapter or the base."""

    source: str
    columns: dict[str, float]
    step: int | None = None  # the checkpoint step loaded (resolved for @latest)
    played: list = dataclasses.field(default_factory=list, repr=False)  # every episode, as the rollouts returned them

    def describe(self) -> str:
        c = self.columns
        lines = [f"{self.source}: {c['eval_episodes']} episodes of its policies ({c['eval_errors']} failed) in {c['eval_s']:.1f}s"]
        for policy in sorted(k.split("/", 1)[1] for k in c if k.startswith("eval_reward_mean/")):
            lines.append(f"  {policy}: win {c[f'eval_win_rate/{policy}']:.3f}, draw {c[f'eval_draw_rate/{policy}']:.3f}, "
                         f"loss {c[f'eval_loss_rate/{policy}']:.3f}, mean reward {c[f'eval_reward_mean/{policy}']:.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report as plain data (`tinkerless eval --json`)."""
        return {"source": self.source, "step": self.step, **self.columns}


def evaluate_games(config: Any, *, ref: Any, adapter: str | None, tasks: list[dict], samples: int, seed: int,
                   source: str) -> GamesReport:
    """`evaluate()` for a multi-agent env (module docstring): load what plays, play the eval seatings, free it."""
    from tinkerless.sdk.backends.client import TrainingClient, free_policies
    from tinkerless.sdk.backends.run_host import run_host_for
    from tinkerless.sdk.evaluation.evaluate import _check_run_in_storage, adapter_files, eval_backend, load_adapter_dirs
    from tinkerless.sdk.run.checkpointing import CLIENT_STATE_FILE, _policy_prefix
    from tinkerless.wire.runs import CheckpointPolicy

    policies = trainable_policies(config.agents)
    if adapter is not None and len(policies) != 1:
        raise ConfigError(f"adapter= is one policy, and this run trains {policies}",
                          hint="evaluate a checkpoint of the run (checkpoint='RUN@STEP'): it holds each policy")
    files = adapter_files(adapter) if adapter is not None else None
    if ref is not None and not ref.is_base and config.backend in ("local", "modal"):
        _check_run_in_storage(config, ref)
    frozen = every_frozen_adapter(config.agents, config.eval_agents)
    backend = eval_backend(config)
    # Names of this evaluation's own: two evaluations on one server never load into each other's policies.
    tag = f"eval-{secrets.token_hex(6)}"
    names = {policy: BASE_POLICY for policy in policies}
    loaded: list[str] = []
    step, played = None, []
    try:
        if files is not None:
            names[policies[0]] = f"{tag}-{policies[0]}"
            loaded.append(names[policies[0]])
            TrainingClient(backend, names[policies[0]], create=False).load_state(
                PolicyState(names[policies[0]], files), include_optimizer=False)
        elif ref is not None and not ref.is_base:
            names = {policy: f"{tag}-{policy}" for policy in policies}
            loaded += names.values()
            restored = run_host_for(backend, config.storage, config.storage_options).checkpoints(ref.run_id).restore(
                [CheckpointPolicy(p, _policy_prefix(p), names[p]) for p in policies], [CLIENT_STATE_FILE], ref.step,
                driver=False)
            if restored.step is None:
                raise UserError(f"run {ref.run_id!r} has no valid checkpoint", hint="see `tinkerless runs`")
            step = restored.step
        frozen = {path: f"{tag}-{name}" for path, name in frozen.items()}
        loaded += frozen.values()
        load_adapter_dirs(backend, frozen)
        rollout_multi = TrainingClient(backend, BASE_POLICY, create=False).rollout_multi
        columns = play_games(rollout_multi, config.replace(group_size=samples, seed=seed), tasks, policies=policies,
                             frozen=frozen, names=names, played=played)
    finally:  # a server keeps what it is not told to free; a failure to free warns, the evaluation's outcome stands
        free_policies([TrainingClient(backend, name, create=False) for name in loaded])
        backend.close()
    return GamesReport(source, columns, step, played)
