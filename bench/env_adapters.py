"""What the env-library adapters cost per step, each against a same-run baseline on the tiny model.

    PYTHONPATH=$PWD .venv/bin/python bench/env_adapters.py [--rounds 5] [--server process|thread] [--json FILE]

- OpenEnv: the same episodes (tasks, seeds, so the same tokens) through an OpenEnv server on loopback
  (its WebSocket client, one session per episode, reused for all its steps) against the same Environment
  in-process; the ratio of seconds per env step. The server runs in its own process by default, as users run
  one (`--server thread`: in a thread of this process, sharing its GIL with the client and the sampler).
- TextArena: a tic-tac-toe self-play rollout through the adapter against native gomoku on a 3x3 board
  (3 in a row: the same game) with the same seats, sampling and limits; the ratio of seconds per game turn.

Rounds alternate the two sides so a load change on a shared machine hits both; the figure is the ratio of the
summed times. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tinkerless  # noqa: E402
from tinkerless.envs.adapters.openenv import serve  # noqa: E402
from tinkerless.envs.gomoku import GomokuEnv  # noqa: E402
from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.wire import pack_code  # noqa: E402
from tinkerless.wire.messages import (  # noqa: E402
    CreatePolicyRequest, EpisodeLimits, LoraConfig, MultiAgentRolloutRequest, RolloutRequest, SamplingParams, Seat,
)
from test_adapter_openenv import GuessEnv  # noqa: E402  (a plain OpenEnv Environment: guess a number)


def openenv_round(worker: Worker, env_cls: type, seed: int) -> tuple[float, int, list]:
    request = RolloutRequest(policy="base", tasks=[{"seed": i} for i in range(8)], group_size=4, env=pack_code(env_cls),
                             sampling=SamplingParams(max_tokens=4, temperature=1.0),
                             limits=EpisodeLimits(max_turns=6, max_episode_tokens=1024), seed=seed)
    started = time.perf_counter()
    episodes = worker.rollout(request).episodes
    seconds = time.perf_counter() - started
    return seconds, sum(e.num_turns for e in episodes), [(e.tokens.tolist(), e.reward) for e in episodes]


def game_round(worker: Worker, env_cls: type, tasks: list[dict], seed: int) -> tuple[float, int]:
    roles = env_cls.agents
    request = MultiAgentRolloutRequest(tasks=tasks, group_size=4, env=pack_code(env_cls),
                                       seats={r: Seat("player") for r in roles},
                                       sampling=SamplingParams(max_tokens=3, temperature=1.0),
                                       limits=EpisodeLimits(max_turns=10, max_episode_tokens=2048), seed=seed,
                                       protocol_timeout=120.0)
    started = time.perf_counter()
    episodes = worker.rollout_multi(request).episodes
    seconds = time.perf_counter() - started
    return seconds, sum(e.num_turns for e in episodes)


@contextlib.contextmanager
def server_process(max_concurrent_envs: int = 64):
    """GuessEnv's OpenEnv server in a process of its own (`serve` under its own interpreter); yields its URL."""
    code = ("import sys, time; sys.path.insert(0, 'tests'); from tinkerless.envs.adapters.openenv import serve; "
            "from test_adapter_openenv import GuessEnv\n"
            f"with serve(GuessEnv, max_concurrent_envs={max_concurrent_envs}) as url:\n"
            "    print(url, flush=True)\n    time.sleep(10**6)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"the OpenEnv server process did not start (exit code {process.poll()})")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--server", choices=("process", "thread"), default="process")
    parser.add_argument("--openenv-only", action="store_true", help="skip the TextArena-against-gomoku rounds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=64, num_layers=2, seed=0)
    worker = Worker(model)
    worker.create_policy(CreatePolicyRequest("player", LoraConfig(rank=4, seed=1)))

    local = tinkerless.envs.openenv(GuessEnv)
    totals = {"in_process": [0.0, 0], "loopback": [0.0, 0]}
    same = True
    with server_process(64) if args.server == "process" else serve(GuessEnv, max_concurrent_envs=64) as url:
        remote = tinkerless.envs.openenv(url)
        openenv_round(worker, local, 0), openenv_round(worker, remote, 0)  # warm both paths
        for r in range(args.rounds):
            for name, env in (("in_process", local), ("loopback", remote)) if r % 2 == 0 else (("loopback", remote), ("in_process", local)):
                seconds, steps, result = openenv_round(worker, env, seed=r + 1)
                totals[name][0] += seconds
                totals[name][1] += steps
                if name == "loopback":
                    same = same and result == openenv_round(worker, local, seed=r + 1)[2]
    per_step = {k: v[0] / max(v[1], 1) for k, v in totals.items()}

    out = {
        "device": "2-core CPU, shared with other jobs", "model": "tiny", "rounds": args.rounds, "server": args.server,
        "openenv_s_per_step": per_step, "openenv_loopback_over_in_process": per_step["loopback"] / per_step["in_process"],
        "openenv_same_tokens_and_rewards": same,
    }
    if not args.openenv_only:
        out.update(game_rounds(worker, args.rounds))
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def game_rounds(worker: Worker, rounds: int) -> dict:
    tictactoe = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")
    gomoku3 = type("Gomoku3", (GomokuEnv,), {"default_size": 3, "default_win_length": 3})
    games = {"textarena": [0.0, 0], "gomoku": [0.0, 0]}
    game_round(worker, tictactoe, [{"seed": 0}], 0), game_round(worker, gomoku3, [{}], 0)
    for r in range(rounds):
        order = (("textarena", tictactoe, [{"seed": s} for s in range(4)]), ("gomoku", gomoku3, [{}] * 4))
        for name, env, tasks in order if r % 2 == 0 else order[::-1]:
            seconds, turns = game_round(worker, env, tasks, seed=r + 1)
            games[name][0] += seconds
            games[name][1] += turns
    per_turn = {k: v[0] / max(v[1], 1) for k, v in games.items()}

    return {"game_s_per_turn": per_turn, "textarena_over_gomoku": per_turn["textarena"] / per_turn["gomoku"],
            "turns": {k: v[1] for k, v in games.items()}}


if __name__ == "__main__":
    main()
