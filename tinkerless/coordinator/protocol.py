"""The interaction protocol of a multi-agent game: whose turn it is, and the limits that end a stuck game.

`TurnKeeper` is the intra-game barrier: an agent may act only when the env
has declared it is that agent's turn, and each action must be acknowledged
before the next turn is asked for. It also turns a protocol that never ends
(an env that never hands the turn on, or one that never finishes) into a
clear error after a turn budget or a wall-clock timeout, never a hang.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tinkerless.errors import BarrierTimeout, EnvError, PhaseError


@dataclass
class TurnKeeper:
    env_name: str
    agents: tuple[str, ...]
    max_turns_per_agent: int
    deadline: float  # time.monotonic() value after which the game is stuck
    turns: dict[str, int] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    _pending: str | None = None

    @classmethod
    def start(cls, env_name: str, agents, max_turns_per_agent: int, timeout: float) -> "TurnKeeper":
        return cls(env_name, tuple(agents), max_turns_per_agent, time.monotonic() + timeout)

    def declare(self, agent: str | None) -> str | None:
        """Record the env's answer to "whose turn?"; validates it and enforces the limits."""
        turn = len(self.history) + 1
        if self._pending is not None:
            raise PhaseError(
                f"{self.env_name}: turn {turn} was requested before {self._pending!r} finished turn {turn - 1}",
                hint="the coordinator must complete a turn before asking for the next one",
            )
        if agent is None:
            return None
        if agent not in self.agents:
            raise EnvError(
                f"{self.env_name}.turn() declared unknown agent {agent!r} at turn {turn}",
                hint=f"turn() must return one of {list(self.agents)} or None when the game is over",
            )
        if time.monotonic() > self.deadline:
            raise BarrierTimeout(
                f"{self.env_name}: the game did not finish within its timeout; stuck at turn {turn} waiting for {agent!r}",
                hint="raise protocol_timeout if games are legitimately long, or make the env end the game",
            )
        if self.turns.get(agent, 0) >= self.max_turns_per_agent:
            raise BarrierTimeout(
                f"{self.env_name}: agent {agent!r} was given the turn more than {self.max_turns_per_agent} times "
                f"(turn {turn}); the env never hands the turn on or never ends the game",
                hint="check turn() and that step() eventually ends the game; or raise max_turns",
            )
        self._pending = agent
        return agent

    def acted(self, agent: str) -> None:
        """Acknowledge `agent`'s action; acting out of turn is refused."""
        if agent != self._pending:
            raise PhaseError(
                f"{self.env_name}: {agent!r} tried to act at turn {len(self.history) + 1}, but it is {self._pending!r}'s turn",
                hint="agents act only when the env's turn() names them",
            )
        self._pending = None
        self.turns[agent] = self.turns.get(agent, 0) + 1
        self.history.append(agent)

    @property
    def turn_number(self) -> int:
        return len(self.history) + 1
