"""`tinkerless eval FILE`: play the env's own episodes with a checkpoint, an adapter or the base model.

    tinkerless eval examples/arithmetic.py --checkpoint my-run@latest --tasks 32 --samples 4
    tinkerless eval examples/arithmetic.py --checkpoint base --transcripts base-episodes.jsonl

What to evaluate is one of the `_policy_flags`; a new kind of policy (e.g. an OpenAI-compatible
endpoint) adds its flag there and its branch in `run`.
"""

from __future__ import annotations

import argparse
import json

from tinkerless.sdk.checkpoints.checkpoint_ref import FORMS
from tinkerless.sdk.tracking.base import tracker_names


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "eval", help="play the env's episodes with a checkpoint or the base model, no training: mean reward, pass@k",
        description="Play each eval task --samples times with the policy named below (the training agent loop, "
        "no training) and report the mean reward, pass@k for k in {1, group_size} (unbiased estimator over the "
        "samples) and episodes/s. Tasks: the config's eval_tasks if it has them, else its tasks. docs/eval.md",
    )
    parser.add_argument("file", help="a Python file that defines `config = tinkerless.TrainConfig(...)`")
    _policy_flags(parser)
    parser.add_argument("--storage", default=None, help="where the run lives (default: the config's storage)")
    parser.add_argument("--backend", default=None, help="e.g. http://host:port: a run hosted by that server (default: the config's backend)")
    parser.add_argument("--model", default=None, help="base model (default: the config's model; a checkpoint must be of a run on it)")
    parser.add_argument("--tasks", type=int, default=None, dest="num_tasks", metavar="N",
                        help="how many eval tasks (default: all of a task list or JSONL file; 8 from a task function)")
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help="episodes per task, the n of pass@k (default: the config's group_size)")
    parser.add_argument("--episodes", type=int, default=None, metavar="N",
                        help="older form: N tasks with one sample each (--tasks N --samples 1)")
    parser.add_argument("--pass-threshold", type=float, default=None, metavar="R",
                        help="an episode passes when its reward >= R (default: when its reward > 0)")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the config's)")
    parser.add_argument("--seed", type=int, default=12345, help="seed of the sampling (default: %(default)s)")
    parser.add_argument(
        "--transcripts", metavar="FILE",
        help="write every episode (messages, rewards, token counts, status, passed) to this JSON-lines file",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--report-to", type=tracker_names, action="extend", metavar="TRACKERS",
                        help="also log the report, a table of episodes and the config to these experiment trackers, "
                        "comma-separated: wandb, tensorboard, mlflow (default: the config's report_to; docs/tracking.md)")
    # Agent functions (docs/agents.md): the same @tinkerless.agent file against any OpenAI-compatible server.
    parser.add_argument("--endpoint", help="an agent config: the OpenAI-compatible base URL to run it against, "
                        "e.g. http://127.0.0.1:8765/v1 (tinkerless serve, vLLM, a hosted API); --model names the served model")
    parser.add_argument("--api-key", help="with --endpoint: the API key (default: $OPENAI_API_KEY, else $TINKERLESS_API_KEY)")
    parser.add_argument("--concurrency", type=int, default=16, help="with --endpoint: agent copies at a time (default: %(default)s)")
    return parser


def _policy_flags(parser: argparse.ArgumentParser) -> None:
    """What plays: one of these (none: the base model)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--checkpoint", metavar="REF", help=f"what to evaluate: {FORMS} (default: base)")
    which.add_argument("--run-id", help="older form of --checkpoint RUN_ID@latest (with --step N: RUN_ID@N)")
    which.add_argument("--adapter", help="a PEFT adapter directory instead of a run checkpoint")
    parser.add_argument("--step", type=int, help="with --run-id: the checkpoint step (default: latest)")


def run(args) -> int:
    from tinkerless.errors import ConfigError
    from tinkerless.sdk.cli.commands import load_config
    from tinkerless.sdk.evaluation.evaluate import evaluate
    from tinkerless.sdk.run.metrics import jsonable

    if args.step is not None and not args.run_id:
        raise ConfigError("--step goes with --run-id", hint="or name the checkpoint as --checkpoint RUN_ID@STEP")
    config = load_config(args.file)
    if args.endpoint is not None or config.agent is not None:  # an agent function: tinkerless.sdk.evaluation.agent_eval
        from tinkerless.sdk.evaluation.agent_eval import agent_eval_command

        args.episodes = args.episodes or args.num_tasks or 32
        return agent_eval_command(args, config)
    given = (("storage", args.storage), ("backend", args.backend), ("model", args.model), ("temperature", args.temperature),
             ("report_to", args.report_to))
    config = config.replace(**{k: v for k, v in given if v is not None})
    report = evaluate(
        config, checkpoint=args.checkpoint, run_id=args.run_id, step=args.step, adapter=args.adapter,
        num_tasks=args.num_tasks, samples=args.samples, episodes=args.episodes, seed=args.seed,
        pass_threshold=args.pass_threshold, transcripts=args.transcripts,
    )
    if args.json:
        print(json.dumps(jsonable(report.to_dict()), allow_nan=False))  # NaN (no episode) becomes null
    else:
        print(report.describe())
    return 0
