"""An agent that sees: SmolLM2-135M with a fresh vision tower learns to name the colour of a shape, on a CPU.

    python examples/vision_colours.py [summary.json [curve.png]]   # chance, SFT warm start, RL, held-out eval

The model (`model="smollm2-llava"`, built and cached on first use by `functions/vision/models.py`): a LLaVA-style
VLM whose language model is SmolLM2-135M-Instruct's real weights and whose SigLIP tower (2 layers, hidden 96,
32 x 32 images in 16 patches) and projector are freshly initialized (no pretrained VLM weights can be had
offline). LoRA trains the language model and the projector (`lora_vision="connector"`); the tower stays frozen.

The task cannot be solved without the image: each picture is a square of one of four colours on a gray
background, at a random place and size, and the question is always the same ("What colour is the square?"), so
chance is 0.25. The reward: 1.0 when the first colour word of the answer is the square's colour, 0.0 for another
colour, 0.1 for an answer that names no colour.
An SFT warm start (20 steps of 16 labelled pictures) teaches the answer's form (one colour word) and a link from
the random tower's features to the words; RL then sharpens it. On the 2-core CPU (2026-11-28, 14 min, heavily
shared): the untrained model 0.11 (it names no colour), RL step 0 (after SFT) 1.00, and on 64 held-out pictures
0.98 at temperature 1.0 and 0.98 greedy after RL (SFT alone: 0.93 and 0.95). bench/results/vision.md has the runs.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 40), "blue": (40, 60, 220), "yellow": (230, 210, 30)}
QUESTION = "What colour is the square? Answer with one word."


def picture(rng, colour: str) -> np.ndarray:
    """A 32 x 32 noisy gray picture with a square of `colour` at a random place and size (`rng`: a random.Random)."""
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-12, 13, size=(32, 32, 3))
    image = (128 + noise).astype(np.uint8)
    side = rng.randint(14, 24)
    top, left = rng.randint(0, 32 - side), rng.randint(0, 32 - side)
    image[top : top + side, left : left + side] = COLOURS[colour]
    return image


def make_task(rng) -> dict:
    colour = rng.choice(sorted(COLOURS))
    return {"prompt": QUESTION, "images": [picture(rng, colour)], "colour": colour}


@tinkerless.reward
def names_the_colour(completion: str, task: dict) -> float:
    words = [w.strip(".,!?:;\"'").lower() for w in completion.split()]
    said = next((w for w in words if w in COLOURS), None)
    if said is None:
        return 0.1
    return 1.0 if said == task["colour"] else 0.0


def demonstrations(count: int, seed: int) -> list[dict]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        task = make_task(rng)
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": task["images"][0]}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": task["colour"].capitalize() + "."},
        ]})
    return out


sft_config = tinkerless.SFTConfig(
    name="vision-colours-sft", model="smollm2-llava", steps=20, batch_size=16, learning_rate=2e-3,
    lora_vision="connector", eval_fraction=0.0, checkpoint_every=20,
)

config = tinkerless.TrainConfig(
    name="vision-colours", model="smollm2-llava", reward=names_the_colour, tasks=make_task,
    steps=20, batch_size=8, group_size=8, max_tokens=4, temperature=1.0, learning_rate=3e-4,
    lora_vision="connector", checkpoint_every=20, seed=3,
)

app = modal_entrypoint(config)  # `modal run examples/vision_colours.py` trains the RL phase on Modal


def main(out: str | None = None, plot: str | None = None) -> dict:
    started = time.perf_counter()
    # Chance: the untrained VLM (its tower has never seen a picture) on 32 held-out pictures, 4 samples each.
    base = tinkerless.evaluate(config, checkpoint="base", num_tasks=32, samples=4)
    warm = tinkerless.sft(sft_config.replace(
        data=demonstrations(sft_config.steps * sft_config.batch_size, seed=config.seed), seed=config.seed))
    sft_s = time.perf_counter() - started
    rl = tinkerless.train(config.replace(init_from=f"{warm.run_id}@latest"))
    # Held out: 64 pictures, at the temperature the run samples with (4 samples each: 256 episodes) and greedy
    # (the policy's most likely answer, what a deployed agent would say), for the SFT-only policy and after RL.
    held_out = {}
    for phase, run_id in (("sft", warm.run_id), ("rl", rl.run_id)):
        for mode, temperature, samples in (("sampled", config.temperature, 4), ("greedy", 0.0, 1)):
            report = tinkerless.evaluate(config.replace(temperature=temperature), checkpoint=f"{run_id}@latest",
                                         num_tasks=64, samples=samples)
            held_out[f"{phase}_{mode}"] = report.mean
    final = held_out["rl_sampled"]
    rewards = [r["reward_mean"] for r in rl.metrics]
    gaps = [r.get("logprob_gap") for r in rl.metrics]
    summary = {"base_reward": base.mean, "sft_then_rl_step0_reward": rewards[0], "final_eval_reward": final,
               "held_out": held_out, "reward_per_step": rewards, "logprob_gap_per_step": gaps, "sft_seconds": sft_s,
               "total_seconds": time.perf_counter() - started}
    print(f"untrained {base.mean:.2f} (chance 0.25), RL step 0 (after SFT) {rewards[0]:.2f}; held out at "
          f"temperature {config.temperature}: SFT {held_out['sft_sampled']:.2f}, after RL {final:.2f}; greedy: SFT "
          f"{held_out['sft_greedy']:.2f}, after RL {held_out['rl_greedy']:.2f}; SFT {sft_s:.0f}s, "
          f"total {summary['total_seconds']:.0f}s")
    print("RL reward per step (step 0 = the SFT-only policy): " + " ".join(f"{r:.2f}" for r in rewards))
    if out:
        with open(out, "w") as handle:
            json.dump(summary, handle, indent=1)
    if plot:
        _plot(summary, plot)
    return summary


def _plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.4))
    steps = range(len(summary["reward_per_step"]))
    axis.plot(steps, summary["reward_per_step"], marker="o", label="RL step reward (step 0: after SFT)")
    axis.axhline(0.25, color="gray", linestyle=":", label="chance (4 colours)")
    axis.axhline(summary["base_reward"], color="red", linestyle="--", label=f"untrained: {summary['base_reward']:.2f}")
    axis.axhline(summary["final_eval_reward"], color="green", linestyle="--",
                 label=f"after RL, held out (temperature 1): {summary['final_eval_reward']:.2f}")
    if "held_out" in summary:
        axis.axhline(summary["held_out"]["rl_greedy"], color="purple", linestyle="-.",
                     label=f"after RL, held out (greedy): {summary['held_out']['rl_greedy']:.2f}")
    axis.set(xlabel="RL step", ylabel="reward", ylim=(0, 1.05), title="smollm2-llava names the square's colour")
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None, sys.argv[2] if len(sys.argv) > 2 else None)
