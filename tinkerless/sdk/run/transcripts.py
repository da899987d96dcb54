"""Transcripts: whole episodes as JSON lines, so a user can read what the model did at step N.

A training run appends a sample of each step's episodes to ``runs/<id>/episodes.jsonl``
(`TrainConfig.transcripts_per_step`); `tinkerless eval --transcripts FILE` writes every
episode it played. Both are built from the `Episode`s the client already receives from
its rollouts, so a run on a server or in the cloud writes the same file as a local one.

One line per episode::

    {"step": 3, "task_index": 1, "policy": "default", "status": "truncated", "truncated_by": "max_turns",
     "reward": 0.5, "turn_rewards": [0.0, 0.5], "num_turns": 2,
     "tokens": {"prompt": 41, "sampled": 23, "total": 77, "sampled_per_turn": [12, 11]},
     "messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...],
     "task": {...}, "info": {...}, "error": null}
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from tinkerless.sdk.run.metrics import jsonable
from tinkerless.wire.content import for_disk
from tinkerless.wire.messages import Episode, EpisodeLimits

TRANSCRIPTS_FILE = "episodes.jsonl"


def episode_record(
    episode: Episode, limits: EpisodeLimits, *, step: int | None = None, task: dict | None = None
) -> dict:
    """One episode as plain JSON data: messages, per-turn rewards, token counts, status and why it stopped."""
    info = dict(episode.info or {})
    record = {
        "step": step,
        "task_index": episode.task_index,
        "policy": info.pop("policy", "default"),
        "status": episode.status,
        "truncated_by": truncated_by(episode, limits),
        "reward": episode.reward,
        "turn_rewards": list(episode.turn_rewards),
        "num_turns": episode.num_turns,
        "tokens": token_counts(episode),
        "messages": for_disk(list(episode.transcript)),  # images by their hash, never their bytes
        "task": for_disk(task),
        "info": info,
        "error": episode.error,
    }
    if episode.infra_cause:  # dropped for an infrastructure failure (sdk/run/infra_failures.py): why
        record["infra_cause"] = episode.infra_cause
    if episode.traceback:
        record["traceback"] = episode.traceback
    return jsonable(record)


def truncated_by(episode: Episode, limits: EpisodeLimits) -> str | None:
    """Which limit cut a truncated episode: `max_turns` or `max_episode_tokens` (None if it was not cut)."""
    if episode.status != "truncated":
        return None
    return "max_turns" if episode.num_turns >= limits.max_turns else "max_episode_tokens"


def token_counts(episode: Episode) -> dict:
    """Prompt, sampled and total tokens, and the tokens the model sampled in each of its turns.

    An agent that rewrote its context has several sequences (`Episode.sequences`): every count covers all
    of them, and `sequences` says how many there were."""
    sequences = episode.sequences()
    per_turn: list[int] = []
    for sequence in sequences:
        mask = np.asarray(sequence.mask) > 0
        # A turn's sampled tokens are one run of mask == 1; prompt and observations are the zeros between.
        edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        per_turn += [int(e - s) for s, e in zip(starts, ends)]
    return {
        "prompt": int(episode.prompt_length),
        "sampled": episode.sampled_tokens(),
        "total": int(sum(len(s.tokens) for s in sequences)),
        "sampled_per_turn": per_turn,
        "sequences": len(sequences),
    }


def sample(episodes: list[Episode], count: int) -> list[Episode]:
    """`count` episodes spread evenly over the step (so over its tasks and groups), in their order."""
    if count <= 0 or not episodes:
        return []
    if count >= len(episodes):
        return list(episodes)
    return [episodes[(i * len(episodes)) // count] for i in range(count)]


def write_transcripts(path: str | Path, records: Iterable[dict]) -> Path:
    """Write `records` as a new JSON-lines file at `path` (replaced whole, never left half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(jsonable(record), allow_nan=False, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
