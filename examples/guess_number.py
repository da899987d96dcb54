"""Multi-turn RL: guess a secret number; the env answers "higher" or "lower".

    tinkerless train examples/guess_number.py

Each guess is a sampled turn (trained, mask 1); the env's replies are
observations (not trained, mask 0). Reward: 1.0 for finding the number,
otherwise partial credit for how close the last guess was, and a small
penalty for a turn with no number in it.
"""

import re

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint

LOW, HIGH = 1, 16


@tinkerless.env
class GuessNumber:
    def system_prompt(self) -> str:
        return "You are playing a guessing game. Reply with a single number."

    def reset(self, secret: int) -> str:
        self.secret = secret
        self.last_guess = None
        return f"I picked a whole number between {LOW} and {HIGH}. Guess it!"

    def step(self, action: str) -> tinkerless.StepResult:
        match = re.search(r"-?\d+", action)
        if match is None:
            return tinkerless.StepResult("Please answer with a number.", reward=-0.1)
        guess = int(match.group())
        self.last_guess = guess
        if guess == self.secret:
            return tinkerless.StepResult(None, reward=1.0, done=True, info={"solved": 1})
        hint = "higher" if guess < self.secret else "lower"
        return tinkerless.StepResult(f"{guess} is wrong. Go {hint}.", reward=0.0)


@tinkerless.reward
def closeness(transcript: list, task: dict) -> float:
    """Partial credit for an unsolved game: how close the last number guessed was."""
    guesses = [int(m) for msg in transcript if msg["role"] == "assistant" for m in re.findall(r"-?\d+", msg["content"])[:1]]
    if not guesses or guesses[-1] == task["secret"]:
        return 0.0
    return 0.5 * max(0.0, 1 - abs(guesses[-1] - task["secret"]) / (HIGH - LOW))


config = tinkerless.TrainConfig(
    name="guess-number",
    model="smollm2",
    env=GuessNumber,
    reward=closeness,
    tasks=lambda rng: {"secret": rng.randint(LOW, HIGH)},
    steps=10,
    batch_size=4,
    group_size=4,
    max_turns=4,
    max_tokens=8,
    max_episode_tokens=256,
    temperature=0.8,
    learning_rate=5e-4,
    checkpoint_every=5,
)

app = modal_entrypoint(config)  # `modal run examples/guess_number.py` trains this config on Modal

if __name__ == "__main__":
    tinkerless.train(config)
