"""tinker-cookbook's on-policy distillation trainer (`distillation.train_on_policy.main`, the one its recipe
`recipes/distillation/on_policy_distillation.py` runs) on `tinkerless serve`, unmodified, with a teacher that is
a saved checkpoint of the same base model.

The recipe's own CLI reads its prompts from the Hub (DeepMath, Tulu3), which this machine cannot reach; this
driver hands the same trainer the cookbook's own `PromptOnlyDataset` (prompts, no reward: the loss is the
teacher's per-token reverse KL only, `kl_penalty_coef=1`) over in-code sums ("What is x + y?"), with the
recipe's settings otherwise. The teacher is `TeacherConfig(base_model=MODEL, load_checkpoint_path=TEACHER)`:
the trainer builds a sampling client from that checkpoint and calls its `compute_logprobs` on every sampled
sequence. As in rl_arithmetic.py the renderer is named (`role_colon`): the cookbook's table has no SmolLM2.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... HF_HUB_OFFLINE=1 \\
        python examples/tinker_cookbook/distill_arithmetic.py MODEL LOG_DIR TEACHER_PATH [--iterations 2]

TEACHER_PATH is a `tinker://.../sampler_weights/...` path of the same server (scripts/cookbook_check.sh distill
makes one with the cookbook's RL trainer first). The last line printed is JSON: one record per iteration with
the trainer's teacher KL and timings.
"""

import argparse
import asyncio
import json
import os
import random
from pathlib import Path

import chz
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer


@chz.chz
class SumsPromptsBuilder(RLDatasetBuilder):
    """The cookbook's prompt-only dataset over `count` sums of two numbers under 100 (a fixed seed)."""

    count: int
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        rng = random.Random(0)
        prompts = [f"What is {rng.randint(0, 99)} + {rng.randint(0, 99)}? Answer with a number." for _ in range(self.count)]
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        return PromptOnlyDataset(prompts, self.groups_per_batch, self.group_size, renderer, tokenizer,
                                 dataset_name="sums"), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("log_dir")
    parser.add_argument("teacher_path")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    builder = SumsPromptsBuilder(count=args.groups * args.iterations, groups_per_batch=args.groups,
                                 group_size=args.group_size, model_name_for_tokenizer=args.model,
                                 renderer_name="role_colon")
    config = train_on_policy.Config(
        recipe_name="recipe_distillation_on_policy",
        learning_rate=1e-4,  # the recipe's LoRA learning rate
        dataset_configs=[DistillationDatasetConfig(
            dataset_builder=builder, groups_per_batch=args.groups,
            teacher_config=TeacherConfig(base_model=args.model, load_checkpoint_path=args.teacher_path))],
        model_name=args.model,
        renderer_name="role_colon",
        lora_rank=32,
        max_tokens=args.max_tokens,
        kl_penalty_coef=1.0,
        kl_discount_factor=0.0,
        log_path=args.log_dir,
        base_url=os.environ.get("TINKER_BASE_URL"),
        eval_every=0,
        save_every=0,
        max_steps=args.iterations,
    )
    asyncio.run(train_on_policy.main(config))
    metrics = [json.loads(line) for line in (Path(args.log_dir) / "metrics.jsonl").read_text().splitlines()]
    keep = ("progress/batch", "teacher_kl", "time/total", "env/all/total_ac_tokens")
    print(json.dumps([{k: m[k] for k in keep if k in m} for m in metrics if "teacher_kl" in m]))


if __name__ == "__main__":
    main()
