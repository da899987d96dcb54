"""Self-play on TextArena's tic-tac-toe: one SmolLM2 policy plays both players, on a CPU.

    tinkerless train examples/textarena_tictactoe_selfplay.py

The game is TextArena's own (`TicTacToe-v0`, its rules, its messages, its invalid-move handling), adapted by
`tinkerless.envs.textarena`: player 0 and player 1 are the roles `player_0` and `player_1`, both seated with
the policy "player". Each reply starts with the env's "[" (mask 0), so the model only has to name a cell
("4]"); an invalid move costs 0.1 and the game's own rules decide when it loses the game.
Every 4 steps the policy plays 32 held-out games against TextArena's random player, 16 in each seat
(`eval_agents`): `eval_win_rate/player` in metrics.jsonl and its panel in metrics.png. Self-play's own win
rate stays near 0.5 whatever the policy learns; this one moves with it.
Use `agents=tinkerless.versus("player_0", random_opponent, roles=TicTacToe.agents, policy="player")` (with
`from tinkerless.envs.adapters.textarena import random_opponent`) to train against a random player instead.
Needs the `textarena` extra.
"""

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.adapters.textarena import random_opponent

TicTacToe = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[", invalid_penalty=-0.1)

config = tinkerless.TrainConfig(
    name="textarena-tictactoe-selfplay",
    model="smollm2",
    env=TicTacToe,
    tasks=TicTacToe.tasks,
    agents=tinkerless.self_play(TicTacToe.agents, policy="player"),
    eval_every=4,
    eval_tasks=[{"seed": seed} for seed in range(4)],
    eval_agents=[tinkerless.versus(role, random_opponent, roles=TicTacToe.agents, policy="player") for role in TicTacToe.agents],
    steps=13,
    batch_size=2,
    group_size=4,
    max_turns=12,
    max_tokens=3,
    max_episode_tokens=2048,
    temperature=1.0,
    learning_rate=1e-3,
    checkpoint_every=4,
)

app = modal_entrypoint(config)

if __name__ == "__main__":
    tinkerless.train(config)
