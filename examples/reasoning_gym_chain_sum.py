"""SmolLM2 on Reasoning Gym's chain_sum (two one-digit terms), scored by the library's own scorer, on a CPU.

    tinkerless train examples/reasoning_gym_chain_sum.py

The tasks, the reward and the system prompt all come from `tinkerless.envs.reasoning_gym`; the reward is the
library's `score_answer`. A 135M model answers with a bare number rather than in the <answer> tag the library's
prompts ask for, so this run overrides the extraction (documented in docs/environment-libraries.md): the tag's
content where there is one, else the first number. Needs the `reasoning-gym` extra.
"""

import re

import tinkerless


def tag_or_first_number(completion: str):
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, flags=re.DOTALL)
    if tagged:
        return tagged[-1].strip()
    number = re.search(r"-?\d+", completion)
    return number.group(0) if number else None


from tinkerless.cloud.modal_entry import modal_entrypoint

gym = tinkerless.envs.reasoning_gym("chain_sum", system_prompt="direct", extract=tag_or_first_number,
                                    min_terms=2, max_terms=2, min_digits=1, max_digits=1)

config = tinkerless.TrainConfig(
    name="reasoning-gym-chain-sum",
    model="smollm2",
    **gym,
    steps=15,
    batch_size=8,
    group_size=4,
    max_tokens=16,
    temperature=1.0,
    learning_rate=1e-3,
    checkpoint_every=5,
)

app = modal_entrypoint(config)

if __name__ == "__main__":
    tinkerless.train(config)
