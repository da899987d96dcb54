"""`tinkerless sft DATA.jsonl` and `tinkerless export-episodes RUN --min-reward R OUT.jsonl`.

    tinkerless sft train.jsonl --steps 50 --batch-size 8 [--init-from RUN@STEP] [--resume --run-id ID]
    tinkerless export-episodes calculator-agent-2026... --min-reward 1.0 best.jsonl

`export-episodes` turns a run's best episodes (its `episodes.jsonl` transcripts) into SFT chat
data: rejection sampling, the data of expert iteration (RL, keep the best, SFT on them, repeat).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tinkerless.errors import DatasetError, UserError
from tinkerless.sdk.tracking.base import tracker_names

COMMANDS = ("sft", "export-episodes")

# SFTConfig fields that `tinkerless sft` takes as flags, with their help (docs/sft.md has the table).
_SFT_FLAGS = {
    "model": (str, "base model (default: smollm2)"),
    "eval_data": (str, "held-out chat JSONL for eval NLL (default: hold out --eval-fraction of DATA)"),
    "eval_fraction": (float, "share of DATA held out for eval NLL when there is no --eval-data (default: 0.1)"),
    "init_from": (str, "warm start from RUN_ID@STEP, RUN_ID@latest, or a PEFT adapter directory"),
    "name": (str, "run name: run ids are NAME-<date>-<time>-<hex> (default: sft)"),
    "steps": (int, "optimizer steps (default: --epochs passes over the training examples)"),
    "epochs": (int, "passes over the data when --steps is not given (default: 1)"),
    "batch_size": (int, "examples per step (default: 8)"),
    "learning_rate": (float, "AdamW learning rate (default: 2e-4)"),
    "lora_rank": (int, "LoRA rank (default: 16)"),
    "lora_alpha": (int, "LoRA alpha (default: 32)"),
    "lora_vision": (str, "a vision-language model's parts trained beside its LM: none, connector or tower (default: none)"),
    "max_length": (int, "tokens per conversation; longer ones are an error naming their line (default: 2048)"),
    "eval_every": (int, "steps between eval-NLL measurements (default: 5)"),
    "seed": (int, "seed of the hold-out split, the data order and the LoRA init (default: 0)"),
    "backend": (str, "local, modal, sky, sky:CLUSTER or http://host:port (default: local)"),
    "engine": (str, "auto, transformers or vllm (default: auto)"),
    "dtype": (str, "base weights: auto (bf16 on a GPU that supports it, else fp32), bf16 or fp32 (default: auto)"),
    "threads": (int, "local CPU threads (default: OMP_NUM_THREADS, else the free usable cores)"),
    "gpus": (int, "train over N GPUs of this machine as FSDP2 ranks (local backend; docs/scaling.md)"),
    "storage": (str, "a directory or fsspec URL for runs/ (default: .)"),
    "run_id": (str, "the run id (default: generated from --name)"),
    "checkpoint_every": (int, "steps between verified checkpoints; the last step is always saved (default: 5)"),
    "keep_checkpoints": (int, "checkpoints kept (default: 3)"),
    "micro_batch_size": (int, "sequences per forward/backward micro-batch (default: 16)"),
    "report_to": (tracker_names, "experiment trackers, comma-separated: wandb, tensorboard, mlflow (docs/tracking.md; default: none)"),
}


def add_parsers(sub) -> None:
    sft = sub.add_parser(
        "sft", help="supervised fine-tuning of a LoRA adapter on chat JSONL (docs/sft.md)",
        description='Train a LoRA adapter with cross-entropy on the assistant turns of DATA: one JSON object per line, '
        '{"messages": [...]} (optional per-message "train": false) or {"prompt": ..., "completion": ...}.',
    )
    sft.add_argument("file", metavar="DATA", help="chat JSONL file")
    for name, (kind, text) in _SFT_FLAGS.items():
        sft.add_argument(f"--{name.replace('_', '-')}", type=kind, dest=name, metavar=name.upper(), help=text,
                         action="extend" if kind is tracker_names else "store")  # --report-to: once or comma-separated
    sft.add_argument("--resume", action="store_true", help="continue run --run-id (or the newest of --name) from its checkpoint")
    sft.add_argument("--no-progress", action="store_true", help="no progress bar")

    export = sub.add_parser(
        "export-episodes", help="write a run's best episodes as SFT chat JSONL (rejection sampling)",
        description="Read RUN's episodes.jsonl transcripts and write those with reward >= --min-reward as "
        '{"messages": [...]} lines for `tinkerless sft`. A run keeps transcripts_per_step episodes per step; '
        "set it to batch_size * group_size to keep every one.",
    )
    export.add_argument("run", metavar="RUN", help="a run id (under STORAGE/runs/), a run directory, or an episodes.jsonl file")
    export.add_argument("out", metavar="OUT.jsonl", help="the SFT file to write (refused if it exists, unless --overwrite)")
    export.add_argument("--min-reward", type=float, required=True, help="keep episodes with at least this reward")
    export.add_argument("--storage", default=".", help="where the run's runs/ directory is (default: %(default)s)")
    export.add_argument("--include-truncated", action="store_true", help="also keep episodes cut by a limit")
    export.add_argument("--keep-duplicates", action="store_true", help="keep identical conversations more than once")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")


def run(args) -> int:
    if args.command == "sft":
        return _sft(args)
    return _export(args)


def _sft(args) -> int:
    from tinkerless.sdk.sft.loop import sft
    from tinkerless.sdk.sft.config import SFTConfig

    settings = {k: getattr(args, k) for k in _SFT_FLAGS if getattr(args, k) is not None}
    config = SFTConfig(data=args.file, resume=args.resume, progress=not args.no_progress, **settings)
    sft(config)
    return 0


def episodes_file(run: str, storage: str) -> Path:
    """The episodes.jsonl of `run`: a file, a run directory, or a run id under `storage`/runs."""
    given = Path(run)
    if given.is_file():
        return given
    if (given / "episodes.jsonl").is_file():
        return given / "episodes.jsonl"
    root = Path(storage) if "://" not in storage else Path(".")  # cloud runs keep their transcripts here
    path = root / "runs" / run / "episodes.jsonl"
    if path.is_file():
        return path
    known = sorted(p.parent.name for p in (root / "runs").glob("*/episodes.jsonl")) if (root / "runs").is_dir() else []
    raise UserError(
        f"no episodes for run {run!r}: {path} does not exist",
        hint=("runs with transcripts here: " + ", ".join(known[-5:])) if known else
        "pass the run id with --storage where it ran, a run directory, or an episodes.jsonl path",
    )


def select_episodes(path: Path, min_reward: float, *, include_truncated: bool = False, keep_duplicates: bool = False):
    """(SFT records, counts): the episodes of `path` worth imitating, as {"messages": [...]} lines."""
    kept, seen = [], set()
    counts = {"read": 0, "below_reward": 0, "failed": 0, "truncated": 0, "duplicates": 0, "no_reply": 0}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}, line {number}: not valid JSON ({exc.msg})", hint="fix or delete that line") from None
            counts["read"] += 1
            reward = record.get("reward")
            if record.get("status") == "error" or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                counts["failed"] += 1
                continue
            if reward < min_reward:
                counts["below_reward"] += 1
                continue
            if record.get("status") == "truncated" and not include_truncated:
                counts["truncated"] += 1
                continue
            messages = [
                {"role": m["role"], "content": m["content"]}
                for m in record.get("messages") or []
                if isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") in ("system", "user", "assistant", "tool")
            ]
            if not any(m["role"] == "assistant" for m in messages):
                counts["no_reply"] += 1
                continue
            key = json.dumps(messages, sort_keys=True)
            if key in seen and not keep_duplicates:
                counts["duplicates"] += 1
                continue
            seen.add(key)
            kept.append({"messages": messages, "source": {"step": record.get("step"), "reward": reward, "task_index": record.get("task_index")}})
    return kept, counts


def _sampling_note(path: Path) -> str | None:
    """Says so when the run kept only a sample of each step's episodes."""
    state = path.parent / "state.json"
    try:
        config = json.loads(state.read_text())["config"]
        kept, made = config["transcripts_per_step"], config["batch_size"] * config["group_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(kept, int) and isinstance(made, int) and kept < made:
        return (
            f"note: this run kept {kept} of its {made} episodes per step (transcripts_per_step={kept}); "
            f"train with transcripts_per_step={made} to export every episode"
        )
    return None


def _export(args) -> int:
    from tinkerless.sdk.run.transcripts import write_transcripts

    if not math.isfinite(args.min_reward):
        raise UserError(f"--min-reward {args.min_reward} is not a number", hint="e.g. --min-reward 1.0")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise UserError(f"{out} already exists; it was left as it is", hint="name another file, or pass --overwrite")
    path = episodes_file(args.run, args.storage)
    records, counts = select_episodes(
        path, args.min_reward, include_truncated=args.include_truncated, keep_duplicates=args.keep_duplicates
    )
    if not records:
        raise UserError(
            f"none of the {counts['read']} episodes in {path} qualifies (reward >= {args.min_reward}); nothing written",
            hint=f"lower --min-reward (skipped: {counts})",
        )
    write_transcripts(out, records)
    skipped = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items() if k != "read" and v)
    print(f"wrote {len(records)} of {counts['read']} episodes to {out}" + (f" (skipped: {skipped})" if skipped else ""))
    note = _sampling_note(path)
    if note:
        print(note)
    return 0


__all__ = ["COMMANDS", "add_parsers", "run"]
