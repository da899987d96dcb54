"""What an LLM judge on the policy's own engine costs a step: the same RL job with a code reward, then with the
code reward plus a judge (SmolLM2 grading SmolLM2's answers), on this CPU.

    python bench/judge_step.py                 # 2 rounds x 5 steps per side, alternating
    python bench/judge_step.py --rounds 1 --steps 4

The job is examples/arithmetic.py's (8 prompts x 4 samples, 12 new tokens). The judge
(`tinkerless.judge(rubric)`, pointwise) runs inside each step's rollout call on the same worker, the base model
with its adapter off, every verdict of the step in one batch. Runs alternate (code, judge, code, ...) so both
see the same machine load; each run's first step is warm-up and left out. Reported: the median step time of
each side and their ratio, the judge's share of the judged step, its cache hit rate, the tokens it read, and
its cost line (compute_s/judge).

A third side makes the comparison fair: `code+cont`, the code reward plus a code-computed term shaped like the
judge's score (a number in [0, 1] that differs whenever two completions' texts differ, from a hash of the
text). Its groups tie exactly when the judge's do (equal texts), so its update trains as many groups and tokens
as the judged step's; the ratio judge / code+cont is the judge's own cost, the ratio code+cont / code is what
a reward without ties costs the update. Reported per side: the median step, trained sequences and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402
from bench.opd_vs_rl import arithmetic_reward, config  # noqa: E402

RUBRIC = "The reply states the correct sum of the two numbers, and nothing but that number."
SIDES = ("code", "code+cont", "judge")


@tinkerless.reward
def text_hash_score(completion: str, task: dict) -> float:
    """A score in [0, 1) that is equal for equal texts and almost never for different ones: the judge's shape
    (continuous, so a group ties only when its completions are the same text) at a code reward's cost."""
    import hashlib

    return int.from_bytes(hashlib.sha256(completion.encode()).digest()[:4], "big") / 2**32


def run(storage: str, steps: int, side: str, seed: int) -> list[dict]:
    reward = {"code": arithmetic_reward, "code+cont": [arithmetic_reward, text_hash_score],
              "judge": [arithmetic_reward, tinkerless.judge(RUBRIC)]}[side]
    result = tinkerless.train(config(storage, steps=steps, reward=reward, seed=seed, checkpoint_every=steps,
                                     keep_checkpoints=1))
    return result.metrics


def _per_round(sides: dict[str, list[dict]], top: str, bottom: str, per_run: int) -> list[float]:
    """Each round's median step of `top` ÷ that of `bottom` (the rounds ran alternated: the same load)."""
    if top not in sides or bottom not in sides:
        return []
    rounds = len(sides[top]) // per_run
    return [round(statistics.median(r["step_s"] for r in sides[top][k * per_run:(k + 1) * per_run])
                  / statistics.median(r["step_s"] for r in sides[bottom][k * per_run:(k + 1) * per_run]), 3)
            for k in range(rounds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--storage", default="/tmp/judge_step")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--suffix", default="", help="appended to the result file's name (judge_step-DATE<suffix>.json)")
    parser.add_argument("--sides", default=",".join(SIDES), help="which of code, code+cont, judge to run")
    parser.add_argument("--first-seed", type=int, default=0, help="round k runs with seed first_seed + k")
    args = parser.parse_args()
    names = args.sides.split(",")
    sides: dict[str, list[dict]] = {side: [] for side in names}
    load: list[float] = []  # the machine's 1-minute load average after each run (2 cores, shared with others)
    for round_ in range(args.rounds):
        for side in names:
            records = run(args.storage, args.steps, side, seed=args.first_seed + round_)
            sides[side].extend(records[1:])  # the first step is warm-up
            load.append(round(os.getloadavg()[0], 2))
            print(side, [round(r["step_s"], 2) for r in records], "load", load[-1], flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in sides[side])

    code_s = median("code", "step_s")
    judge_s = median("judge", "step_s")
    judged = sides["judge"]
    questions = sum(r["judge_cache_hit_rate"] is not None for r in judged)
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": "2-core CPU, shared with other jobs",
        "steps_per_side": len(sides["code"]), "code_step_s_median": code_s, "judge_step_s_median": judge_s,
        "ratio_judge_to_code": judge_s / code_s,
        **({"cont_step_s_median": median("code+cont", "step_s"),
            "ratio_judge_to_code_cont": judge_s / median("code+cont", "step_s"),
            "ratio_code_cont_to_code": median("code+cont", "step_s") / code_s} if "code+cont" in sides else {}),
        "trained_sequences_per_step_median": {side: median(side, "trained_sequences") for side in sides},
        "trained_tokens_per_step_median": {side: median(side, "trained_tokens") for side in sides},
        "update_s_per_step_median": {side: median(side, "compute_s/update") for side in sides
                                     if all("compute_s/update" in r for r in sides[side])},
        "judge_share_of_step": statistics.median(r["judge_s"] / r["step_s"] for r in judged),
        "judge_share_of_rollout": statistics.median(r["judge_share"] for r in judged),
        "judge_cache_hit_rate": statistics.mean(r["judge_cache_hit_rate"] for r in judged) if questions else None,
        "judge_prompt_tokens_per_step": statistics.median(r["judge_prompt_tokens"] for r in judged),
        "compute_s_judge_per_step": statistics.median(r["compute_s/judge"] for r in judged),
        "compute_s_rollout_per_step_judged": statistics.median(r["compute_s/rollout"] for r in judged),
        "compute_s_rollout_per_step_code": statistics.median(r["compute_s/rollout"] for r in sides["code"]),
        "reward_mean_code": statistics.mean(r["reward_mean"] for r in sides["code"]),
        "reward_mean_judged": statistics.mean(r["reward_mean"] for r in judged),
        "step_s": {side: [round(r["step_s"], 3) for r in sides[side]] for side in sides},
        "ratio_judge_to_code_cont_per_round": _per_round(sides, "judge", "code+cont", args.steps - 1),
        "ratio_judge_to_code_per_round": _per_round(sides, "judge", "code", args.steps - 1),
        "load_1min_after_each_run": load,
    }
    path = Path(args.out) / f"judge_step-{result['date']}{args.suffix}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
