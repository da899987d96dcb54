"""`ToolEnv`: the base class of tool-using envs, and the public face of tool calling.

A `ToolEnv` subclass provides `tools`, `reset(**task)` and `score(answer)`; each turn the
env reads the model's text, runs the tool it calls and answers the result, until an
answer ends the episode. A reply with neither a tool call nor an answer is scored as if
the whole reply were the answer, so a model that never learned the tags still gets a
reward signal.

The parts live next door, and every name is importable from here as before:
- `tool_schema`: `@tool` and `Tool` (JSON schemas from annotations and docstrings, argument checks);
- `tool_format`: the `<tool_call>` / `<tool_response>` / `<answer>` text format (parsing, describing tools).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tinkerless.envs import tool_format
from tinkerless.envs.base import StepResult
from tinkerless.envs.sandbox.limits import SandboxUnavailable

# Re-exported (and listed in __all__): these were defined here before tool_format and tool_schema split off.
from tinkerless.envs.tool_format import (
    Action,
    FinalAnswer,
    ParseError,
    ToolCall,
    ToolObservation,
    describe_tools,
    format_result,
    parse_action,
)
from tinkerless.envs.tool_schema import Tool, ToolCallError, tool
from tinkerless.errors import EnvError, UserCodeError

# Private names that other modules still import from here (openai_api/render.py and streaming.py read
# <tool_call> the way ToolEnv does): the same objects as in tool_format.
_TOOL_CALL_OPEN = tool_format._TOOL_CALL_OPEN
_TOOL_CALL_CLOSE = tool_format._TOOL_CALL_CLOSE
_parse_call = tool_format._parse_call

# A tool that cannot run on this machine at all ends the run loudly instead of becoming an
# observation: a missing sandbox must never turn into episodes that silently fail every call.
TOOL_UNAVAILABLE: tuple[type[BaseException], ...] = (SandboxUnavailable,)


@dataclass
class ToolCallRecord:
    """One attempted call in an episode. `ok` is True when the tool ran and returned."""

    name: str
    arguments: dict
    ok: bool
    result: str


class ToolEnv:
    """Base class for tool-using envs. Subclass, set `tools`, implement `reset(**task)` and `score(answer)`.

        @tinkerless.env
        class MathEnv(ToolEnv):
            tools = [calculator]
            def reset(self, question, answer): self.answer = answer; return question
            def score(self, answer): return float(str(self.answer) in answer)

    Each turn: a tool call runs the tool and answers `<tool_response>...</tool_response>`
    (reward 0; a tool that raises answers `error: ...` and the episode goes on, except
    TOOL_UNAVAILABLE errors, which end the run); an
    unknown tool, bad arguments or unreadable call answers an error and costs
    `format_penalty`; an answer ends the episode with `score(answer)`. Every attempted
    call counts towards `max_tool_calls`; one more ends the episode with
    `out_of_tool_calls()` (0 by default). A turn with neither a call nor an answer
    is scored as if the whole text were the answer.
    """

    tools: ClassVar[list[Tool]] = []
    max_tool_calls: ClassVar[int] = 4
    format_penalty: ClassVar[float] = 0.0
    max_response_chars: ClassVar[int] = 1000  # long tool outputs are cut to keep episodes within the token budget
    instructions: ClassVar[str] = "Solve the task. Use a tool when it helps, then give your final answer."

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Mistakes in the class definition surface at import, not in the middle of a rollout.
        if not isinstance(cls.tools, (list, tuple)):
            raise UserCodeError(f"{cls.__qualname__}.tools must be a list of tools, got {type(cls.tools).__name__}", hint="tools = [my_tool]")
        for item in cls.tools:
            if not isinstance(item, Tool):
                raise UserCodeError(
                    f"{cls.__qualname__}.tools holds {item!r}, which is not a Tool",
                    hint="decorate each tool function with @tinkerless.tool",
                )
        names = [t.name for t in cls.tools]
        if len(set(names)) != len(names):
            raise UserCodeError(f"{cls.__qualname__}.tools has duplicate names: {names}", hint="give each tool a unique name")
        if not isinstance(cls.max_tool_calls, int) or cls.max_tool_calls < 0:
            raise UserCodeError(f"{cls.__qualname__}.max_tool_calls must be an int >= 0, got {cls.max_tool_calls!r}")

    # Per-episode history, created on first use so subclasses need not call super().__init__().
    @property
    def calls(self) -> list[ToolCallRecord]:
        return self.__dict__.setdefault("_tool_calls", [])

    def system_prompt(self) -> str:
        return f"{self.instructions}\n\n{describe_tools(self.tools)}"

    def score(self, answer: str) -> float:
        raise EnvError(
            f"{type(self).__qualname__} does not define score(answer)",
            hint="a ToolEnv subclass implements score(self, answer: str) -> float for the final answer",
        )

    def out_of_tool_calls(self) -> float:
        """Reward when the episode ends because the model kept calling tools; override for partial credit."""
        return 0.0

    def step(self, action: str) -> StepResult:
        parsed = parse_action(action)
        if parsed is None:
            parsed = FinalAnswer(action.strip())
        if isinstance(parsed, FinalAnswer):
            return StepResult(None, reward=self.score(parsed.text), done=True, info=self._info(answered=1))
        if len(self.calls) >= self.max_tool_calls:
            return StepResult(None, reward=self.out_of_tool_calls(), done=True, info=self._info(answered=0, out_of_tool_calls=1))
        if isinstance(parsed, ParseError):
            self.calls.append(ToolCallRecord(name="", arguments={}, ok=False, result=parsed.message))
            return self._respond(f"error: {parsed.message}", penalty=True)
        return self._run(parsed)

    def _run(self, call: ToolCall) -> StepResult:
        by_name = {t.name: t for t in self.tools}
        chosen = by_name.get(call.name)
        if chosen is None:
            message = f"unknown tool {call.name!r}; available tools: {', '.join(by_name) or 'none'}"
            self.calls.append(ToolCallRecord(call.name, call.arguments, ok=False, result=message))
            return self._respond(f"error: {message}", penalty=True)
        try:
            arguments = chosen.bind(**call.arguments)
        except ToolCallError as exc:
            self.calls.append(ToolCallRecord(call.name, call.arguments, ok=False, result=exc.message))
            return self._respond(f"error: {exc.message}", penalty=True)
        try:
            value = chosen.fn(**arguments)
            result = format_result(value)
        except TOOL_UNAVAILABLE:
            raise
        except Exception as exc:  # a failing tool is information for the model, not a crashed episode
            message = str(exc) or type(exc).__name__
            self.calls.append(ToolCallRecord(call.name, arguments, ok=False, result=message))
            return self._respond(f"error: {message}", penalty=False)
        ok = value.ok if isinstance(value, ToolObservation) else True
        self.calls.append(ToolCallRecord(call.name, arguments, ok=ok, result=result))
        return self._respond(result, penalty=False)

    def _respond(self, text: str, *, penalty: bool) -> StepResult:
        if len(text) > self.max_response_chars:
            text = text[: self.max_response_chars] + "...(truncated)"
        reward = -abs(self.format_penalty) if penalty else 0.0
        return StepResult(f"<tool_response>{text}</tool_response>", reward=reward, done=False, info=self._info())

    def _info(self, **extra: int) -> dict:
        return {"tool_calls": len(self.calls), "tool_errors": sum(not c.ok for c in self.calls), **extra}


__all__ = [
    "Action",
    "FinalAnswer",
    "ParseError",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolCallRecord",
    "ToolEnv",
    "ToolObservation",
    "TOOL_UNAVAILABLE",
    "describe_tools",
    "format_result",
    "parse_action",
    "tool",
]
