"""tinker-cookbook's supervised recipe (`sl_basic`'s trainer) on `tinkerless serve`, unmodified.

The cookbook resolves a renderer from a table of hosted model names, which has no entry
for a local checkpoint, so this driver names the renderer explicitly and feeds the
cookbook's own example conversations. Everything else is the cookbook's
`supervised.train.main`, talking to the server through the official `tinker` SDK.

    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... \\
        python examples/tinker_cookbook/sl_conversations.py MODEL_PATH LOG_DIR [N_CONVERSATIONS]

Run it with the cookbook's own environment (`scripts/cookbook_check.sh` builds one).
"""

import asyncio
import json
import os
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig


def main() -> None:
    model_path, log_dir = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    source = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    subset = Path(log_dir) / "conversations.jsonl"
    subset.parent.mkdir(parents=True, exist_ok=True)
    subset.write_text("".join(source.read_text().splitlines(keepends=True)[:limit]))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_path,
        renderer_name="role_colon",
        max_length=512,
        batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = train.Config(
        log_path=log_dir,
        model_name=model_path,
        recipe_name="tinkerless_sl_conversations",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(subset)),
        learning_rate=2e-4,
        lr_schedule="linear",
        num_epochs=1,
        lora_rank=16,
        base_url=os.environ.get("TINKER_BASE_URL"),
        save_every=2,
    )
    asyncio.run(train.main(config))
    metrics = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
    print(json.dumps({"steps": len(metrics), "first": metrics[0], "last": metrics[-1]}, indent=1, default=str))


if __name__ == "__main__":
    main()
