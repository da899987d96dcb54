"""Single-turn RL: SmolLM2-135M learns to answer small sums, on a CPU.

    tinkerless train examples/arithmetic.py

The reward gives partial credit so a 135M model has signal to learn from
(a strict exact-match reward stays at 0 for this model):
1.0 if the first number in the answer is the correct sum, plus 0.5 if the
answer is nothing but that number.
"""

import re

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint


def make_task(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"What is {a} + {b}? Answer with a number.", "answer": a + b}


@tinkerless.reward
def arithmetic_reward(completion: str, task: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)
    if not numbers or int(numbers[0]) != task["answer"]:
        return 0.0
    only_the_number = completion.strip().rstrip(".") == str(task["answer"])
    return 1.0 + (0.5 if only_the_number else 0.0)


config = tinkerless.TrainConfig(
    name="arithmetic",
    model="smollm2",
    reward=arithmetic_reward,
    tasks=make_task,
    steps=20,
    batch_size=8,
    group_size=4,
    max_tokens=12,
    temperature=0.7,
    learning_rate=5e-4,
    lora_rank=16,
    checkpoint_every=5,
)

app = modal_entrypoint(config)  # `modal run examples/arithmetic.py` trains this config on Modal

if __name__ == "__main__":
    tinkerless.train(config)
