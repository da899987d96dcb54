"""What a step of `train()` asks the functions to play, and whether what came back can be trained on.

`RolloutRequests` packs the user's env, reward and agent code once per run and builds each step's requests from
the config: sampling, episode limits and the step's seed (`step_seed`: a step's episodes replay from it).
`check_errors` applies `on_env_error` to the episodes that failed.
"""

from __future__ import annotations

from typing import Any

from tinkerless.errors import EnvError
from tinkerless.sdk.config import TrainConfig
from tinkerless.sdk.run.judging import split_reward
from tinkerless.wire import pack_code
from tinkerless.wire.messages import Episode, MultiAgentRolloutRequest, RolloutRequest


def step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def _pack(obj: Any) -> Any:
    return pack_code(obj, name=getattr(obj, "__qualname__", None)) if obj else None


class RolloutRequests:
    """The run's rollout requests. Made first thing: an unpicklable env fails here, before any model loads."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.env_code = _pack(config.env)
        reward, self.judge = split_reward(config.reward)  # code rewards run as one function; the judge beside them
        self.reward_code = _pack(reward)
        self.agent_code = _pack(config.agent)

    def single_agent(self, tasks: list[dict], step: int) -> RolloutRequest:
        config = self.config
        return RolloutRequest(
            policy="default",
            tasks=tasks,
            group_size=config.group_size,
            sampling=self.config.sampling_params(),
            limits=self.config.episode_limits(),
            seed=step_seed(config.seed, step),
            env=self.env_code,
            reward=self.reward_code,
            system_prompt=config.system_prompt,
            agent=self.agent_code,
            agent_timeout=config.agent_timeout,
            agent_transport=config.agent_transport,
            judge=self.judge,
        )

    def multi_agent(self, tasks: list[dict], step: int, seats: Any, index: int) -> MultiAgentRolloutRequest:
        """The request for the `index`-th game batch of a multi-agent step (`multi_agent.play_step` makes them)."""
        config = self.config
        return MultiAgentRolloutRequest(
            tasks=tasks,
            group_size=config.group_size,
            env=self.env_code,
            seats=seats,
            sampling=self.config.sampling_params(),
            limits=self.config.episode_limits(),
            seed=step_seed(config.seed, step) + index,
            protocol_timeout=config.protocol_timeout,
        )



def check_errors(episodes: list[Episode], config: TrainConfig, step: int) -> None:
    """Raise unless the failed episodes may be dropped (`on_env_error='skip'`) and some episode is left to train on."""
    errors = [e for e in episodes if e.status == "error"]
    if errors and (config.on_env_error == "raise" or len(errors) == len(episodes)):
        first = errors[0]
        raise EnvError(
            f"{len(errors)} of {len(episodes)} episodes failed at step {step}; first: {first.error}\n{first.traceback or ''}",
            hint="fix the env/reward; with on_env_error='skip' failing episodes are dropped and the run goes on"
            if config.on_env_error == "raise"
            else "every episode failed, so there is nothing to train on; fix the env/reward",
        )
