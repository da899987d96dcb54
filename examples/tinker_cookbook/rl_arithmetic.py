"""tinker-cookbook's RL trainer (`rl.train.main`) on `tinkerless serve`, unmodified.

The environment is the cookbook's own in-code arithmetic task (`recipes/math_rl/arithmetic_env`:
"What is x + y?", reward for the right integer, a small format penalty), so nothing is
downloaded. Each iteration the trainer samples `GROUPS` groups of `GROUP_SIZE` rollouts
(one `sample` call per rollout, all in flight together), then trains on them with
`importance_sampling` (the trainer's default) and takes an optimizer step.

The cookbook picks a renderer from a table of hosted model names, which has no entry for
SmolLM2 or a local checkpoint, so this driver names one (`role_colon`). Everything else
is the cookbook's code talking to the server through the official `tinker` SDK.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... HF_HUB_OFFLINE=1 \\
        python examples/tinker_cookbook/rl_arithmetic.py MODEL LOG_DIR [--iterations 2] [--groups 8] [--group-size 4]

MODEL is the Hub id the server advertises (`HuggingFaceTB/SmolLM2-135M-Instruct`) or a local
model directory. Run it with the cookbook's own environment (`scripts/cookbook_check.sh`
builds one); `bench/cookbook_rl.py` drives it against a server with and without batching.
The last line printed is JSON: one record per iteration with the trainer's own timings.
"""

import argparse
import asyncio
import json
import os
from pathlib import Path

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("log_dir")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--async-off-policy", type=int, default=0,
                        help="the cookbook's async mode: sample while training, at most N steps off policy (0: off)")
    args = parser.parse_args()
    model, log_dir = args.model, args.log_dir
    iterations, groups, group_size, max_tokens = args.iterations, args.groups, args.group_size, args.max_tokens
    config = train.Config(
        log_path=log_dir,
        model_name=model,
        renderer_name="role_colon",
        recipe_name="tinkerless_rl_arithmetic",
        dataset_builder=ArithmeticDatasetBuilder(
            batch_size=groups, group_size=group_size, n_batches=iterations,
            model_name_for_tokenizer=model, renderer_name="role_colon",
        ),
        learning_rate=4e-5,
        max_tokens=max_tokens,
        lora_rank=32,
        eval_every=0,
        save_every=0,
        num_groups_to_log=0,  # the rollout transcripts are client-side work that is not the server's to measure
        base_url=os.environ.get("TINKER_BASE_URL"),
        async_config=train.AsyncConfig(max_steps_off_policy=args.async_off_policy, groups_per_batch=groups)
        if args.async_off_policy else None,
    )
    asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    keep = ("progress/batch", "time/total", "time/sampling", "time/train_step",
            "time/do_train_step_and_get_sampling_client", "env/all/reward/total", "env/all/total_ac_tokens")
    rows = [{k: m[k] for k in keep if k in m} for m in metrics if "time/total" in m]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
