"""Environments: the env protocol (`StepResult`, reward checks) and built-in envs."""

from tinkerless.envs.base import StepResult, as_step_result, check_reward

__all__ = ["StepResult", "as_step_result", "check_reward"]
