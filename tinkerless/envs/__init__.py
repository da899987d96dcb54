"""Environments: the env protocols and built-in envs.

- `base`: `StepResult` (single-agent `step`), `MultiStepResult` (multi-agent `step`), reward checks;
- `tools`: `@tool`, `ToolEnv` and the tool-calling format (`<tool_call>{...}</tool_call>`, `<answer>...</answer>`);
  its parts are `tool_schema` (`@tool`, `Tool`: JSON schemas from annotations and docstrings, argument checks)
  and `tool_format` (reading a model's turn, describing tools, formatting results); all importable from `tools`;
- `calculator`: math word problems with a calculator tool;
- `python_tool`: problems solved by running model-written Python in `sandbox` (bubblewrap: its own uid and
  namespaces, seccomp and limits; a `modal.Sandbox` on Modal; see docs/sandbox.md);
- `adapters/`: envs from the libraries users already have (Reasoning Gym, TextArena, OpenEnv, GEM), each an
  optional extra imported when used: `tinkerless.envs.reasoning_gym(...)`, `textarena(...)`, `openenv(...)`, `gem(...)`;
- `gomoku`: two-player gomoku with scripted `random_opponent` / `greedy_opponent`; reading a move from
  a model's answer (`parse_move`) is `gomoku_moves`, importable from `gomoku`.
"""

from tinkerless.envs.base import MultiStepResult, StepResult, as_step_result, check_reward, is_multi_agent

from tinkerless.envs.adapters import gem, openenv, reasoning_gym, text_gym, textarena

__all__ = ["MultiStepResult", "StepResult", "as_step_result", "check_reward", "is_multi_agent",
           "gem", "openenv", "reasoning_gym", "text_gym", "textarena"]
