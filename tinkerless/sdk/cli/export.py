"""`tinkerless export RUN_ID@STEP OUT [--merged]`: a checkpoint as a PEFT adapter or merged weights (docs/eval.md)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "export", help="write a checkpoint as a standard PEFT adapter directory, or merged weights + tokenizer",
        description="Write checkpoint REF of a run to the new directory OUT: adapter_config.json + "
        "adapter_model.safetensors (load with peft's PeftModel.from_pretrained), or with --merged the base "
        "model with the adapter merged in, plus its tokenizer, chat template and generation config (load with "
        "transformers' AutoModelForCausalLM). OUT must not exist or be empty. docs/eval.md",
    )
    parser.add_argument("checkpoint", metavar="REF", help="RUN_ID@STEP or RUN_ID@latest (see `tinkerless runs`)")
    parser.add_argument("out", metavar="OUT", help="a new (or empty) directory to write")
    parser.add_argument("--merged", action="store_true", help="merge the adapter into the base model's weights")
    parser.add_argument("--storage", default=".", help="where the run lives: a directory or fsspec URL (default: %(default)s)")
    parser.add_argument("--backend", default="local",
                        help="local (the default) or modal: the run is in --storage; http://host:port: a run kept by that "
                        "`tinkerless serve` server (key: $TINKERLESS_API_KEY)")
    parser.add_argument("--model", default=None, help="the run's base model (default: as the run recorded it); another is refused")
    parser.add_argument("--policy", default="default", help="which policy of a multi-agent run (default: %(default)s)")
    return parser


def run(args) -> int:
    from tinkerless.sdk.checkpoints.export import export

    result = export(
        args.checkpoint, args.out, merged=args.merged, storage=args.storage, backend=args.backend, model=args.model,
        policy=args.policy,
    )
    print(result.describe())
    return 0
