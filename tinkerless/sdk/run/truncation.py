"""Episodes cut off by max_turns / max_episode_tokens: per-step metrics and the one-time warning.

An episode the limits cut off is still trained on, as it is; when that happens to most
episodes of a step the run is probably not training what the user meant (a 6-turn game
trained on its first turn), so the run says so once, naming the knob to raise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tinkerless.wire.messages import Episode

if TYPE_CHECKING:
    from tinkerless.sdk.config import TrainConfig

WARNING_FRACTION = 0.5  # warn when more than this share of a step's episodes was cut off


def columns(episodes: list[Episode], turn_limit: int) -> dict:
    """Metrics columns: the truncated share and which limit cut the episodes off."""
    truncated = [e for e in episodes if e.status == "truncated"]
    by_turns = sum(e.num_turns >= turn_limit for e in truncated)
    return {
        "episodes_truncated_frac": len(truncated) / len(episodes) if episodes else 0.0,
        "episodes_truncated_by_turns": by_turns,
        "episodes_truncated_by_tokens": len(truncated) - by_turns,
    }


def warrants_warning(record: dict) -> bool:
    return record.get("episodes_truncated_frac", 0.0) > WARNING_FRACTION


def warning(record: dict, config: TrainConfig) -> str:
    by_turns, by_tokens = record["episodes_truncated_by_turns"], record["episodes_truncated_by_tokens"]
    knobs = []
    if by_turns:
        default = "" if config.max_turns is not None else ", the default for an env run" if config.env else ", the default"
        knobs.append(f"{by_turns} reached max_turns={config.turn_limit()}{default}: raise max_turns")
    if by_tokens:
        knobs.append(
            f"{by_tokens} reached max_episode_tokens={config.max_episode_tokens}: raise max_episode_tokens or lower max_tokens"
        )
    total = record["episodes_truncated_by_turns"] + record["episodes_truncated_by_tokens"]
    return (
        f"warning: at step {record['step']}, {total} of {record['episodes']} episodes were cut off before the env "
        f"ended them ({'; '.join(knobs)}). They are trained as they are. (Said once per run; the metrics column "
        "episodes_truncated_frac has every step.)"
    )
