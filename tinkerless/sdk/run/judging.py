"""`tinkerless.judge(...)`: an LLM judge as a reward, composable with code rewards.

    reward=tinkerless.judge("The answer is correct and says only the number.")
    reward=[correct, tinkerless.judge("Polite and concise.", weight=0.5)]      # summed
    reward=tinkerless.judge(rubric, mode="group")                              # a task's group ranked together
    reward=tinkerless.judge(rubric, endpoint="http://127.0.0.1:9000/v1", model="judge-7b")

The judge runs inside the rollout call, right after the step's episodes are played, on the same worker: by
default the policy's base model with its adapters off, every verdict of the step in one batch
(`functions/companions/judge.py` says how the prompt fences the completion and how the verdict is read). Its
seconds are the run's `judge` phase, apart from the rollout's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from tinkerless.errors import ConfigError
from tinkerless.wire.messages import JudgeSpec


def judge(rubric: str, model: str | None = None, mode: str = "pointwise", *, endpoint: str | None = None,
          weight: float = 1.0, timeout: float = 60.0, retries: int = 2, max_tokens: int = 16) -> JudgeSpec:
    """A reward: `weight` times the judge's score in [0, 1] of each episode against `rubric`."""
    spec = JudgeSpec(rubric=rubric, mode=mode, model=model, endpoint=endpoint, weight=weight, timeout=timeout,
                     retries=retries, max_tokens=max_tokens)
    check_judge(spec)
    return spec


def check_judge(spec: JudgeSpec) -> None:
    """The judge's settings, as the worker will check them, as a ConfigError now."""
    from tinkerless.errors import InvalidRequest
    from tinkerless.wire.validate import validate

    if not isinstance(spec.rubric, str) or not spec.rubric.strip():
        raise ConfigError(f"a judge needs a rubric, got {spec.rubric!r}", hint="say in plain words what a good completion does")
    if isinstance(spec.weight, bool) or not isinstance(spec.weight, (int, float)) or not math.isfinite(spec.weight):
        raise ConfigError(f"judge weight must be a finite number, got {spec.weight!r}")
    try:
        validate(spec)
    except InvalidRequest as exc:
        raise ConfigError(f"tinkerless.judge: {exc.message}", hint=exc.hint or "see docs/judges.md") from None


class SumOfRewards:
    """Several code rewards as one: their sum (what `reward=[f, g]` trains on)."""

    __tinkerless_reward__ = True

    def __init__(self, rewards: list[Callable]):
        self.rewards = list(rewards)
        self.__qualname__ = " + ".join(getattr(r, "__qualname__", type(r).__name__) for r in self.rewards)

    def __call__(self, completion: Any, task: dict) -> float:
        return float(sum(r(completion, task) for r in self.rewards))


def split_reward(reward: Any) -> tuple[Callable | None, JudgeSpec | None]:
    """(the code reward, the judge) of a `reward=` setting: a function, a judge, or a list of them."""
    parts = list(reward) if isinstance(reward, (list, tuple)) else ([] if reward is None else [reward])
    judges = [p for p in parts if isinstance(p, JudgeSpec)]
    code = [p for p in parts if not isinstance(p, JudgeSpec)]
    if len(judges) > 1:
        raise ConfigError("a run takes one judge", hint="write one rubric that covers what the judges would ask")
    for part in code:
        if not callable(part):
            raise ConfigError(f"reward {part!r} is neither a function nor a tinkerless.judge(...)",
                              hint="reward=my_reward, reward=tinkerless.judge(rubric), or a list of them")
    for judge_spec in judges:
        check_judge(judge_spec)
    fn = None if not code else code[0] if len(code) == 1 else SumOfRewards(code)
    return fn, (judges[0] if judges else None)


def step_columns(spec: JudgeSpec | None, stats: dict | None, rollout_s: float, usage: Any) -> dict:
    """With a judge: its seconds move from the rollout phase to its own (`usage`), and the step's columns: its
    seconds, its share of the rollout's wall time, the cache hit rate, the tokens it read, the verdicts it failed."""
    stats = stats or {}
    if spec is None or "judge_questions" not in stats:
        return {}
    usage.move(stats.get("judge_s", 0.0), "rollout", "judge")
    questions = stats["judge_questions"]
    return {
        "judge_s": stats.get("judge_s", 0.0),
        "judge_share": stats.get("judge_s", 0.0) / rollout_s if rollout_s > 0 else 0.0,
        "judge_cache_hit_rate": stats.get("judge_cache_hits", 0.0) / questions if questions else math.nan,
        "judge_prompt_tokens": stats.get("judge_prompt_tokens", 0.0),
        "judge_failed": stats.get("judge_failed", 0.0),
    }
