"""One step's metrics record: rewards, losses, tokens, timings and episode counts, as metrics.jsonl keeps it."""

from __future__ import annotations

import math

import numpy as np

from tinkerless.wire.messages import Episode


# What a rollout reports about its own work (`RolloutResult.stats`), copied into the step's record:
# prompt tokens prefilled, reused from kept KV caches, tokens decoded; seconds generating, in the env's
# own code (reset, step, reward), encoding prompts and decoding samples. The rest of `rollout_s` is
# the transport, scheduling and the loop's own bookkeeping.
ROLLOUT_COLUMNS = ("prefill_tokens", "cached_prompt_tokens", "decoded_tokens", "generate_s", "env_s", "encode_s", "decode_s")


def step_record(
    step: int, episodes: list[Episode], metrics: dict[str, dict], timings: dict, versions: dict[str, int], seconds: float,
    rollout_stats: dict | None = None,
) -> dict:
    ok = [e for e in episodes if e.status != "error"]
    rewards = [e.reward for e in ok]
    sampled = float(sum(e.sampled_tokens() for e in episodes))
    merged = merge_policy_metrics(metrics)
    record = {
        "step": step,
        "reward_mean": mean(rewards),
        "reward_std": float(np.std(rewards)) if rewards else math.nan,
        "loss": merged.get("loss", math.nan),
        "kl": merged.get("kl", math.nan),
        "entropy": merged.get("entropy", math.nan),
        "grad_norm": merged.get("grad_norm", math.nan),
        "clip_fraction": merged.get("clip_fraction", math.nan),
        # mean |sampler - trainer| log-prob of the trained tokens, and the KL estimate mean(sampler - trainer)
        "logprob_gap": merged.get("logprob_gap", math.nan),
        "kl_sample_train": merged.get("kl_sample_train", math.nan),
        **({"tis_weight_mean": merged["tis_weight_mean"]} if "tis_weight_mean" in merged else {}),  # with tis_cap
        "sampled_tokens": sampled,
        "trained_tokens": sum(m.get("tokens", 0.0) for m in metrics.values()),
        "tokens_per_s": sampled / max(timings["rollout_s"], 1e-9),
        "episodes": len(episodes),
        "episodes_error": len(episodes) - len(ok),
        "episodes_truncated": sum(e.status == "truncated" for e in episodes),
        "trained_sequences": sum(m.get("trained_sequences", 0) for m in metrics.values()),
        "turns_mean": mean([e.num_turns for e in ok]),
        "policy_version": max(versions.values()) if versions else 0,
        "step_s": seconds,
        **timings,
    }
    for key in ROLLOUT_COLUMNS:
        value = (rollout_stats or {}).get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            record[key] = float(value)
    errors = [e for e in episodes if e.status == "error"]
    if errors:
        record["errors"] = [{"task_index": e.task_index, "error": e.error, "traceback": e.traceback} for e in errors[:5]]
    sample = next((e for e in ok), None)
    if sample is not None:
        record["sample"] = sample.transcript[-1]["content"][:200]
    return record


def merge_policy_metrics(metrics: dict[str, dict]) -> dict[str, float]:
    """One value per metric across policies: the mean over policies that reported it."""
    keys = {k for m in metrics.values() for k in m}
    return {k: mean([m[k] for m in metrics.values() if k in m and m[k] is not None]) for k in keys}


def agent_metrics(episodes: list[Episode], policies: list[str]) -> dict[str, float]:
    """Per-policy reward and win/draw/loss rates over finished games."""
    out: dict[str, float] = {}
    for name in policies:
        own = [e for e in episodes if e.status != "error" and e.info.get("policy") == name]
        out[f"reward_mean/{name}"] = mean([e.reward for e in own])
        finished = [e for e in own if e.info.get("outcome") in ("win", "draw", "loss")]
        for outcome in ("win", "draw", "loss"):
            out[f"{outcome}_rate/{name}"] = mean([e.info["outcome"] == outcome for e in finished]) if finished else math.nan
    return out


def mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else math.nan


def agent_result_metrics(episodes: list[Episode]) -> dict[str, float]:
    """The step means of the metrics agents returned in `AgentResult.metrics`, as `agent/<name>` columns."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        if episode.status != "error":
            for name, value in (episode.info.get("agent_metrics") or {}).items():
                values.setdefault(name, []).append(float(value))
    out = {f"agent/{name}": mean(column) for name, column in values.items()}
    drift = [e.info["render_drift_turns"] for e in episodes if "render_drift_turns" in e.info]
    if drift:  # agent functions' calls whose prompt re-rendered an earlier reply otherwise (recording.py)
        out["render_drift_turns"] = float(sum(drift))
    return out
