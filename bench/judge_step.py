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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402
from bench.opd_vs_rl import arithmetic_reward, config  # noqa: E402

RUBRIC = "The reply states the correct sum of the two numbers, and nothing but that number."


def run(storage: str, steps: int, judged: bool, seed: int) -> list[dict]:
    reward = [arithmetic_reward, tinkerless.judge(RUBRIC)] if judged else arithmetic_reward
    result = tinkerless.train(config(storage, steps=steps, reward=reward, seed=seed, checkpoint_every=steps,
                                     keep_checkpoints=1))
    return result.metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--storage", default="/tmp/judge_step")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    sides: dict[str, list[dict]] = {"code": [], "judge": []}
    for round_ in range(args.rounds):
        for side in ("code", "judge"):
            records = run(args.storage, args.steps, side == "judge", seed=round_)
            sides[side].extend(records[1:])  # the first step is warm-up
    code_s = statistics.median(r["step_s"] for r in sides["code"])
    judge_s = statistics.median(r["step_s"] for r in sides["judge"])
    judged = sides["judge"]
    questions = sum(r["judge_cache_hit_rate"] is not None for r in judged)
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": "2-core CPU, shared with other jobs",
        "steps_per_side": len(sides["code"]), "code_step_s_median": code_s, "judge_step_s_median": judge_s,
        "ratio_judge_to_code": judge_s / code_s,
        "judge_share_of_step": statistics.median(r["judge_s"] / r["step_s"] for r in judged),
        "judge_share_of_rollout": statistics.median(r["judge_share"] for r in judged),
        "judge_cache_hit_rate": statistics.mean(r["judge_cache_hit_rate"] for r in judged) if questions else None,
        "judge_prompt_tokens_per_step": statistics.median(r["judge_prompt_tokens"] for r in judged),
        "compute_s_judge_per_step": statistics.median(r["compute_s/judge"] for r in judged),
        "compute_s_rollout_per_step_judged": statistics.median(r["compute_s/rollout"] for r in judged),
        "compute_s_rollout_per_step_code": statistics.median(r["compute_s/rollout"] for r in sides["code"]),
        "reward_mean_code": statistics.mean(r["reward_mean"] for r in sides["code"]),
        "reward_mean_judged": statistics.mean(r["reward_mean"] for r in judged),
    }
    path = Path(args.out) / f"judge_step-{result['date']}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
