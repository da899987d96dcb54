"""Multi-agent RL: SmolLM2 plays gomoku (black) against a random opponent (white), on a CPU.

    tinkerless train examples/gomoku_vs_random.py

The learner is trained only on its own moves; the opponent's moves reach it
as observation text. Zero-sum terminal reward (+1 win, -1 loss, 0 draw) and
a penalty for an invalid move, which is retried (three invalid answers forfeit
the game). A 135M model starts out answering in the wrong format and loses
by forfeit; its win rate rises as it learns to play legal moves.
Writes runs/<id>/outcomes.png with win/draw/loss rate against step.
"""

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.gomoku import GomokuEnv, random_opponent

config = tinkerless.TrainConfig(
    name="gomoku-vs-random",
    model="smollm2",
    env=GomokuEnv,
    agents=tinkerless.versus("black", random_opponent, roles=("black", "white"), policy="black"),
    tasks=lambda rng: {"size": 4, "win_length": 3},
    steps=12,
    batch_size=2,
    group_size=4,
    max_turns=8,
    max_tokens=4,
    max_episode_tokens=1536,
    temperature=1.0,
    learning_rate=1e-3,
    checkpoint_every=4,
)

app = modal_entrypoint(config)  # `modal run examples/gomoku_vs_random.py` trains this config on Modal

if __name__ == "__main__":
    tinkerless.train(config)
