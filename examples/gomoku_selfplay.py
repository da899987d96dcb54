"""Self-play: one policy plays both colours of gomoku against itself, on a CPU.

    tinkerless train examples/gomoku_selfplay.py

Each game yields two episodes for the same policy, one per colour; each is
trained only on its own side's moves with its own (zero-sum) reward, and
advantages compare games played from the same seat. Use
`agents=tinkerless.round_robin(["a", "b", "c"], roles=("black", "white"))`
to train several policies against each other instead.
"""

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.gomoku import GomokuEnv

config = tinkerless.TrainConfig(
    name="gomoku-selfplay",
    model="smollm2",
    env=GomokuEnv,
    agents=tinkerless.self_play(("black", "white"), policy="player"),
    tasks=lambda rng: {"size": 4, "win_length": 3},
    steps=8,
    batch_size=2,
    group_size=4,
    max_turns=12,
    max_tokens=4,
    max_episode_tokens=2048,
    temperature=1.0,
    learning_rate=1e-3,
    checkpoint_every=4,
)

app = modal_entrypoint(config)  # `modal run examples/gomoku_selfplay.py` trains this config on Modal

if __name__ == "__main__":
    tinkerless.train(config)
