"""The `tinkerless` command: train, runs, eval, export.

    tinkerless train examples/arithmetic.py [--steps 20] [--resume --run-id ID]
    tinkerless runs [--storage DIR | --server URL]
    tinkerless eval examples/arithmetic.py --checkpoint RUN_ID@STEP|RUN_ID@latest|base [--samples 4] [--transcripts FILE]
    tinkerless export RUN_ID@STEP OUT [--merged]   # a PEFT adapter directory, or merged weights + tokenizer
    tinkerless config-reference          # every TrainConfig field (docs/config.md)

An example file defines a module-level `config = tinkerless.TrainConfig(...)`;
command-line flags override its fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

from tinkerless.functions.precision import DTYPES
from tinkerless.errors import ConfigError, TinkerlessError, UserCodeError
from tinkerless.sdk.cli import evaluate as cli_eval, export as cli_export, sft as cli_sft
from tinkerless.sdk.tracking.base import tracker_names


def load_config(path: str):
    """Import a user file as a module (so its code pickles by value) and return its TrainConfig."""
    from tinkerless.sdk.config import TrainConfig

    file = Path(path)
    if not file.exists():
        raise ConfigError(f"{path} does not exist", hint="pass the path to a Python file defining `config`")
    name = file.stem.replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # cloudpickle needs the module registered to ship it by value
    sys.path.insert(0, str(file.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        import traceback

        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(file)]
        frame = (frames or traceback.extract_tb(exc.__traceback__))[-1]
        line = exc.lineno if isinstance(exc, SyntaxError) else frame.lineno
        if isinstance(exc, ConfigError):  # e.g. a misspelled TrainConfig field: the same error as in train()
            raise ConfigError(f"{path}, line {line}: {exc.message}", hint=exc.hint) from exc
        raise UserCodeError(
            f"{path} failed to import: {type(exc).__name__}: {exc} (line {line})",
            hint="fix the error in that file; it must import cleanly and define `config`",
        ) from exc
    config = getattr(module, "config", None)
    if not isinstance(config, TrainConfig):
        found = [k for k, v in vars(module).items() if isinstance(v, TrainConfig)]
        if len(found) != 1:
            raise ConfigError(
                f"{path} must define `config = tinkerless.TrainConfig(...)`",
                hint="see examples/arithmetic.py",
            )
        config = getattr(module, found[0])
    return config


# TrainConfig fields that `tinkerless train` takes as flags (every field can be set in the file).
_OVERRIDES = {
    "steps": int,
    "model": str,
    "backend": str,
    "storage": str,
    "run_id": str,
    "name": str,
    "seed": int,
    "batch_size": int,
    "group_size": int,
    "max_tokens": int,
    "max_turns": int,
    "max_episode_tokens": int,
    "learning_rate": float,
    "checkpoint_every": int,
    "eval_every": int,
    "temperature": float,
    "loss": str,
    "algo": str,
    "engine": str,
    "dtype": str,
    "transcripts_per_step": int,
    "threads": int,
    "max_staleness": int,
    "rollout_workers": int,
    "gpus": int,
    "init_from": str,
    "teacher": str,
    "distill_coef": float,
    "report_to": tracker_names,  # --report-to wandb,tensorboard (or the flag once per tracker); none: no trackers
}

_EPILOG = """\
Every TrainConfig field, with its default and meaning: docs/config.md or `tinkerless config-reference`.
A run stopped with Ctrl-C or SIGTERM is marked interrupted and resumes with --resume --run-id ID."""


def _parser() -> argparse.ArgumentParser:
    from tinkerless.sdk.config_reference import field_help

    parser = argparse.ArgumentParser(
        prog="tinkerless", description="RL-train LLM agents from plain Python.", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    train = sub.add_parser(
        "train", help="train the config defined in a Python file", epilog=_EPILOG,
        description="Train `config = tinkerless.TrainConfig(...)` from FILE; flags override its fields.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("file", help="a Python file that defines `config = tinkerless.TrainConfig(...)`")
    for name, kind in _OVERRIDES.items():
        train.add_argument(
            f"--{name.replace('_', '-')}", type=kind, dest=name, metavar=name.upper(), help=field_help(name),
            action="extend" if kind is tracker_names else "store",
        )
    train.add_argument(
        "--resume", action="store_true",
        help="continue run --run-id (or the newest run of the config's name) from its latest checkpoint",
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")

    serve = sub.add_parser("serve", help="serve a model over HTTP for backend='http://host:port'")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    serve.add_argument("--model", default="smollm2", help="the base model every tenant's adapters train on (default: %(default)s)")
    serve.add_argument("--also-model", action="append", default=[], metavar="ID",
                       help="another base model to hold beside --model, for forward (log-probs) and sampling: a "
                       "teacher of another base for on-policy distillation (repeatable; docs/serving.md)")
    serve.add_argument("--storage", default=".", help="where API keys, the runs driven through this server and Tinker checkpoints live (a directory or fsspec URL; default: %(default)s)")
    serve.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024, help="larger requests get HTTP 413 (default: %(default)s)")
    serve.add_argument("--max-pending", type=int, default=1024, help="queued calls before HTTP 429 (default: %(default)s)")
    _serving_limit_flags(serve)
    serve.add_argument("--no-auth", action="store_true", help="accept calls without an API key (trusted networks only)")
    serve.add_argument("--price-per-hour", type=float, default=None, metavar="DOLLARS",
                       help="$/hour the keys' budgets are charged at (default: the list price of the device; the CPU's is 0)")
    serve.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for the model (default: OMP_NUM_THREADS, else the free usable cores; docs/threads.md)",
    )
    serve.add_argument(
        "--dtype", choices=DTYPES, default="auto",
        help="precision of the base weights: auto (bf16 on a GPU that supports it, fp32 on a CPU), bf16 or fp32; "
        "LoRA weights and optimizer state stay fp32 (default: %(default)s)",
    )
    serve.add_argument(
        "--single-user", action="store_true",
        help="run clients' env/reward code inside the server process instead of a sandbox per tenant (your own server only)",
    )
    serve.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="also accept the API key held in environment variable NAME (tenant 'default'); never pass keys as arguments",
    )
    serve.add_argument(
        "--gpus", type=int, default=None, metavar="N",
        help="train over N GPUs of this machine as FSDP2 ranks, sampling on one (default: 1, or torchrun's "
        "LOCAL_WORLD_SIZE; docs/scaling.md)",
    )

    estimate = sub.add_parser("estimate", help="what the config's run will take: device-seconds and dollars per GPU class "
                              "and on this CPU (docs/budgets.md)")
    estimate.add_argument("file", help="a Python file that defines `config = tinkerless.TrainConfig(...)`")
    estimate.add_argument("--no-calibrate", action="store_true", help="skip the CPU calibration (its first steps, run here)")

    keys = sub.add_parser("keys", help="manage API keys of a `tinkerless serve` storage")
    keys.add_argument("action", choices=("create", "list", "revoke", "set-budget", "usage"),
                      help="create a key (printed once), list keys, revoke one, set a key's budget, or show what keys spent")
    keys.add_argument("key_id", nargs="?", help="the key id to revoke, budget or show (see `tinkerless keys list`)")
    keys.add_argument("--tenant", help="tenant the new key belongs to (needed by create)")
    keys.add_argument("--budget-usd", metavar="DOLLARS",
                      help="what the key may spend on the server's compute (create, set-budget; 'none': no limit; docs/budgets.md)")
    keys.add_argument("--storage", default=".", help="the server's --storage (default: %(default)s)")

    runs = sub.add_parser(
        "runs", help="list runs in a storage location, with the device-seconds they used and their estimated cost",
        description="List runs, newest first. STATUS is running, finished, failed, or interrupted (stopped by "
        "Ctrl-C/SIGTERM, or its process vanished: no heartbeat for a while).",
    )
    runs.add_argument("--storage", default=".", help="a directory or fsspec URL holding runs/ (default: %(default)s)")
    runs.add_argument(
        "--server", help="list the runs kept by this `tinkerless serve` URL instead (key: $TINKERLESS_API_KEY)"
    )

    cli_eval.add_parser(sub)
    cli_export.add_parser(sub)

    cli_sft.add_parsers(sub)  # sft, export-episodes

    sub.add_parser(
        "config-reference", help="print every TrainConfig field with its default and meaning (Markdown)",
        description="Print the TrainConfig reference that docs/config.md holds.",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "runs":
            return _runs(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "keys":
            return _keys(args)
        if args.command == "estimate":
            from tinkerless.sdk.run.estimate import estimate

            print(estimate(load_config(args.file), calibrate=not args.no_calibrate).table())
            return 0
        if args.command in cli_sft.COMMANDS:
            return cli_sft.run(args)
        if args.command == "config-reference":
            from tinkerless.sdk.config_reference import render_markdown

            sys.stdout.write(render_markdown())
            return 0
        if args.command == "export":
            return cli_export.run(args)
        return cli_eval.run(args)
    except TinkerlessError as exc:
        print(f"tinkerless: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM during a run (tinkerless.sdk.run.lifecycle)
        from tinkerless.sdk.run.lifecycle import RunInterrupted

        stopped = exc if isinstance(exc, RunInterrupted) else RunInterrupted("SIGINT")
        command = f"tinkerless {args.command} {getattr(args, 'file', '')}".rstrip()
        if stopped.run_id is not None:
            print(f"tinkerless: {stopped}\n  {command} --resume --run-id {stopped.run_id}", file=sys.stderr)
        else:
            print(f"tinkerless: {stopped if args.command == 'train' else 'interrupted'}", file=sys.stderr)
        return stopped.exit_code


def _train(args) -> int:
    from tinkerless.sdk.run.trainer import train

    config = load_config(args.file)
    changes = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    if args.resume:
        changes["resume"] = True
    if args.no_progress:
        changes["progress"] = False
    train(config.replace(**changes))
    return 0


def _serving_limit_flags(serve) -> None:
    """`tinkerless serve` flags for per-request limits and tenant quotas (docs/serving-limits.md)."""
    try:
        from tinkerless.server.limits import ServingLimits
    except ImportError:  # no serve extra: `tinkerless serve` says so when run
        return
    defaults = ServingLimits()
    helps = {
        "max_tokens": "tokens one sample (or one episode turn) may generate",
        "max_samples": "sequences one sample request may ask for (prompts x num_samples)",
        "max_prompt_tokens": "tokens of one prompt",
        "max_group_size": "a rollout request's group_size",
        "max_rollouts": "episodes one rollout request may run (tasks x group_size)",
        "max_policies_per_tenant": "LoRA policies one tenant may hold on the worker at once",
    }
    for name, text in helps.items():
        serve.add_argument(ServingLimits.flag(name), type=int, default=getattr(defaults, name),
                           help=f"{text}; more is HTTP 400 (default: {getattr(defaults, name)})")
    serve.add_argument("--max-pending-per-tenant", type=int, default=256,
                       help="one tenant's queued or running calls before HTTP 429 (default: 256)")
    serve.add_argument("--slice-seconds", type=float, default=0.05,
                       help="how long a generation runs before yielding to other tenants' calls (default: 0.05)")


def _serve(args) -> int:
    try:
        from tinkerless.server import serve
        from tinkerless.server.limits import ServingLimits
    except ImportError as exc:
        raise ConfigError(f"`tinkerless serve` needs fastapi and uvicorn ({exc})", hint="pip install 'tinkerless[serve]'") from exc
    if not (math.isfinite(args.slice_seconds) and args.slice_seconds >= 0):
        raise ConfigError(f"--slice-seconds {args.slice_seconds} is not a duration", hint="pass 0 or more seconds, e.g. 0.05")
    extra_keys = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env, "")
        if not key:
            raise ConfigError(
                f"--api-key-env {args.api_key_env}: that environment variable is empty or unset",
                hint=f"export {args.api_key_env}=<key> (e.g. from `tinkerless keys create`) before starting the server",
            )
        extra_keys = {key: "default"}
    serve(
        args.host, args.port, model=args.model, storage=args.storage, auth=not args.no_auth, extra_keys=extra_keys,
        max_request_bytes=args.max_request_bytes, max_pending=args.max_pending,
        max_pending_per_tenant=args.max_pending_per_tenant, slice_seconds=args.slice_seconds, single_user=args.single_user,
        limits=ServingLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServingLimits)}),
        threads=args.threads, dtype=args.dtype, gpus=_gpus(args), price_per_hour=args.price_per_hour,
        also_models=args.also_model,
    )
    return 0


def _gpus(args) -> int:
    """--gpus, else the ranks torchrun was asked for (`torchrun --nproc-per-node N -m tinkerless.sdk.cli serve`)."""
    gpus = args.gpus if args.gpus is not None else int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} is not a number of GPUs", hint="1 or more")
    if int(os.environ.get("LOCAL_RANK") or 0) > 0:  # torchrun started one process a rank: the first starts them all
        raise SystemExit(0)
    return gpus


def _keys(args) -> int:
    from tinkerless.server.budgets import stored_usage, usage_row
    from tinkerless.server.keys import KeyStore, parse_budget
    from tinkerless.storage import ObjectStore

    store = KeyStore(ObjectStore(args.storage))
    budget = parse_budget(args.budget_usd) if args.budget_usd is not None else None
    if args.action == "create":
        if not args.tenant:
            raise ConfigError("keys create needs --tenant NAME")
        print(store.create(args.tenant, budget_usd=budget))
        print("store this key now: only its hash is kept", file=sys.stderr)
    elif args.action == "set-budget":
        if not args.key_id or args.budget_usd is None:
            raise ConfigError("keys set-budget needs the key id and --budget-usd DOLLARS (or 'none')")
        store.set_budget(args.key_id, budget)
        print(f"{args.key_id}: budget {'none' if budget is None else f'${budget:.2f}'} (a running server applies it "
              "on the key's next call)")
    elif args.action == "usage":
        spent = stored_usage(store.store)
        for record in store.list():
            if args.key_id in (None, record.key_id):
                row = usage_row(record.key_id, record.tenant, record.budget_usd, spent.get(record.key_id, {}), 0.0, None)
                limit = "no limit" if row["budget_usd"] is None else f"of ${row['budget_usd']:.2f}"
                print(f"{record.key_id}  {record.tenant:<20} ${row['spent_usd']:.4f} {limit:<14} "
                      f"{row['compute_seconds']:.1f} s in {row['calls']} calls"
                      + (f" (judge: {row['judge_seconds']:.1f} s, {row['judge_tokens']} tokens read, "
                         f"{row['judge_verdicts']} verdicts)" if row["judge_verdicts"] else ""))
    elif args.action == "list":
        for record in store.list():
            state = "revoked" if record.revoked else "active"
            print(f"{record.key_id}  {record.tenant:<20} {state:<8} {time.strftime('%Y-%m-%d %H:%M', time.gmtime(record.created_at))}")
    else:
        if not args.key_id:
            raise ConfigError("keys revoke needs the key id (see `tinkerless keys list`)")
        store.revoke(args.key_id)
        print(f"revoked {args.key_id}")
    return 0


def _runs(args) -> int:
    from tinkerless.coordinator import list_runs
    from tinkerless.sdk.run.accounting import format_cost, latest_usage, seconds_total
    from tinkerless.storage import ObjectStore

    if args.server:
        from tinkerless.sdk.backends.http import HTTPBackend
        from tinkerless.sdk.backends.server_runs import ServerRunHost

        http = HTTPBackend(args.server, timeout=60)
        try:
            runs, where = ServerRunHost(http).list(), args.server
        finally:
            http.close()
    else:
        runs, where = list_runs(ObjectStore(args.storage)), args.storage
    if not runs:
        print(f"no runs in {where}")
        return 0
    print(
        f"{'RUN':<40} {'STATUS':<11} {'STEP':>9} {'REWARD first→last':>22} {'CHECKPOINT':>10} "
        f"{'GPU-SECONDS':>11} {'COST':>10}  DEVICE"
    )
    for run in runs:
        total = run.config.get("steps", "?")
        s = run.summary
        first, last = s.get("reward_first", s.get("reward_first3")), s.get("reward_last", s.get("reward_last3"))
        reward = f"{_fmt(first)} → {_fmt(last)}" if ("reward_last" in s or "reward_last3" in s) else "-"
        if run.config.get("kind") == "sft":  # SFT runs (tinkerless.sft): their train NLL where RL runs show reward
            reward = f"SFT nll {_fmt(s.get('train_nll_first'))} → {_fmt(s.get('train_nll_last'))}" if "train_nll_last" in s else "SFT"
        ckpt = "-" if run.last_checkpoint_step is None else f"step-{run.last_checkpoint_step}"
        usage = latest_usage(s)  # from the finish summary or, for a run still going, its last committed step
        seconds = "-" if usage is None else f"{seconds_total(usage):.1f}"
        cost = "-" if usage is None else format_cost(usage.get("cost_usd"))
        device = "-" if usage is None else usage.get("device", "?")
        print(
            f"{run.run_id:<40} {run.status:<11} {f'{run.step}/{total}':>9} {reward:>22} {ckpt:>10} "
            f"{seconds:>11} {cost:>10}  {device}"
        )
    return 0


def _fmt(value) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
