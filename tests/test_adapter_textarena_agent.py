"""A TextArena game played by an `@tinkerless.agent` function (the OpenAI client), against the random player: the
game's own rewards, every sampled token recorded, and a training run."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("textarena")

import textarena as ta  # noqa: E402

import tinkerless  # noqa: E402
from tinkerless.envs.adapters.textarena import random_opponent  # noqa: E402
from tinkerless.functions.hosting.agent_functions import run_agent_episodes  # noqa: E402
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams  # noqa: E402

PENALTY = -0.1
TicTacToe = tinkerless.envs.textarena("TicTacToe-v0", invalid_penalty=PENALTY)
played: list[tuple[int, list[str], int, float]] = []  # (seed, every move in order, completion tokens reported, reward)


@tinkerless.agent
async def play_tictactoe(client, task):
    """Player 0 is the policy, through chat completions; player 1 is TextArena's random player."""
    game, rng = TicTacToe(), random.Random(task["seed"])
    game.reset(seed=task["seed"])
    messages, moves, reward, completion_tokens = [], [], 0.0, 0
    while (role := game.turn()) is not None:
        if role == "player_1":
            move = random_opponent(game, role, rng)
        else:
            messages.append({"role": "user", "content": game.observation(role)})
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            text = reply.choices[0].message.content
            completion_tokens += reply.usage.completion_tokens
            messages.append({"role": "assistant", "content": text})
            # The agent's own parsing (a random tiny model writes bytes): its first character names a cell, so
            # games last several turns, with taken cells as invalid moves.
            move = f"[{ord(text[0]) % 9 if text else 0}]"
        moves.append(move)
        reward += game.step(role, move).rewards["player_0"]
    played.append((task["seed"], moves, completion_tokens, reward))
    return reward


def _library_reward(seed: int, moves: list[str]) -> float:
    """Player 0's reward from TextArena itself for the same moves, plus the adapter's invalid-move penalties."""
    env = ta.make("TicTacToe-v0-raw")
    env.reset(num_players=2, seed=seed)
    penalties = 0.0
    for move in moves:
        player, errors = env.state.current_player_id, env.state.error_count
        done, _ = env.step(move)
        invalid = env.state.error_count > errors or (done and (env.state.game_info.get(player) or {}).get("invalid_move"))
        penalties += PENALTY if invalid and player == 0 else 0.0
        if done:
            break
    rewards, _ = env.close()
    return rewards[0] + penalties


def test_an_agent_function_plays_a_textarena_game_through_the_openai_client(worker):
    played.clear()
    tasks = [{"seed": s} for s in (1, 2, 3)]
    episodes = run_agent_episodes(
        worker.engine, worker.tokenizer, agent=play_tictactoe, policy=BASE_POLICY, tasks=tasks, group_size=2,
        sampling=SamplingParams(max_tokens=4, temperature=1.0), limits=EpisodeLimits(24, 8192), seed=5, timeout=120.0,
    )
    assert len(episodes) == 6 and all(e.status == "ok" for e in episodes), [e.error for e in episodes]
    assert len(played) == 6 and any(len(moves) > 2 for _, moves, _, _ in played)  # games of several turns
    for seed, moves, _, reward in played:  # the game's own reward: TextArena replayed apart with the same moves
        assert reward == pytest.approx(_library_reward(seed, moves))
    assert sorted(e.reward for e in episodes) == pytest.approx(sorted(reward for *_, reward in played))
    # Every token the policy sampled is in the episodes with mask 1, and nothing else is: the counts agree.
    masked = sum(int(np.sum(np.asarray(s.mask) > 0)) for e in episodes for s in e.sequences())
    assert masked == sum(tokens for _, _, tokens, _ in played) > 0


def test_train_an_agent_function_on_a_textarena_game(tiny_model, tmp_path):
    result = tinkerless.train(model=tiny_model, agent=play_tictactoe, tasks=TicTacToe.tasks, steps=2, batch_size=2,
                              group_size=2, max_tokens=4, max_turns=24, max_episode_tokens=8192, storage=str(tmp_path),
                              progress=False, learning_rate=1e-3)
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert all(m["episodes_error"] == 0 and m["episodes"] == 4 for m in result.metrics)
