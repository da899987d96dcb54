"""Win rate of a policy against TextArena's random player (`random_opponent`), before and after training.

    PYTHONPATH=$PWD .venv/bin/python bench/textarena_vs_random.py [--adapter DIR] [--games 32] [--model smollm2]

tinkerless's `evaluate()` plays single-agent envs; this plays a two-player game with the policy in one seat and
the adapter's uniformly random valid mover in the other, half the games in each seat (TextArena tic-tac-toe:
player 0 moves first), with the sampling the training run used. `--adapter` is a PEFT adapter directory (a
run's checkpoint `adapter/`); without it the base model plays. Every game's seed is fixed, so two policies
meet the same openings and the same random moves (the opponent's generator is seeded per game). Prints one JSON
object: wins, draws, losses per seat and in all, and the win rate.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import tinkerless
from tinkerless.envs.adapters.textarena import random_opponent
from tinkerless.functions.models import resolve_model
from tinkerless.functions.worker import Worker
from tinkerless.sdk.evaluation.evaluate import adapter_files
from tinkerless.wire import pack_code
from tinkerless.wire.messages import (
    CreatePolicyRequest, EpisodeLimits, LoadStateRequest, LoraConfig, MultiAgentRolloutRequest, PolicyState,
    SamplingParams, Seat,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--adapter", default=None, help="a PEFT adapter directory; the base model if left out")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--game", default="TicTacToe-v0")
    parser.add_argument("--games", type=int, default=32, help="games in all, half with the policy moving first")
    parser.add_argument("--max-tokens", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    Game = tinkerless.envs.textarena(args.game, response_prefix="[", invalid_penalty=-0.1)
    worker = Worker(resolve_model(args.model))
    if args.adapter:
        worker.load_state(LoadStateRequest(PolicyState("player", adapter_files(args.adapter)), include_optimizer=False))
    else:
        worker.create_policy(CreatePolicyRequest("player", LoraConfig(rank=16, seed=0)))  # LoRA B = 0: the base model
    tasks = [{"seed": args.seed + i} for i in range(args.games // 2)]
    outcomes: dict[str, Counter] = {}
    for learner in Game.agents:
        seats = {role: Seat("player") if role == learner else Seat(opponent=pack_code(random_opponent), trainable=False)
                 for role in Game.agents}
        episodes = worker.rollout_multi(MultiAgentRolloutRequest(
            tasks=tasks, group_size=1, env=pack_code(Game), seats=seats,
            sampling=SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature),
            limits=EpisodeLimits(max_turns=12, max_episode_tokens=2048), seed=args.seed, protocol_timeout=600.0,
        )).episodes
        outcomes[learner] = Counter(e.info["outcome"] for e in episodes)
    total = sum(outcomes.values(), Counter())
    games = sum(total.values())
    print(json.dumps({"game": args.game, "model": args.model, "adapter": args.adapter, "games": games,
                      "temperature": args.temperature, "per_seat": {k: dict(v) for k, v in outcomes.items()},
                      "outcomes": dict(total), "win_rate": total["win"] / max(games, 1)}, indent=1))


if __name__ == "__main__":
    main()
