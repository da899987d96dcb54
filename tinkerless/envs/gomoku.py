"""Gomoku (k in a row on an n×n board) as a two-player multi-agent env.

Roles are "black" (moves first, X) and "white" (O). See `tinkerless.envs.base`
for the multi-agent protocol a coordinator drives: `turn()`, `observation(agent)`,
`step(agent, text)` until `turn()` is None.

Coordinates: columns are letters a.. (left to right), rows are numbers 1..n
(top to bottom, as rendered). Internally a cell is a 0-based `(row, col)` pair.

Reading a move from a model's answer (the accepted formats, and which mention
counts) is `tinkerless.envs.gomoku_moves`; its names are importable from here.

Opponents needing no model are plain functions
`opponent(env: GomokuEnv, agent: str, rng: random.Random) -> str` returning a move
text. They take the env (not the observation text) so they can read the board
directly instead of re-parsing it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from tinkerless.envs.base import MultiStepResult
from tinkerless.envs.gomoku_moves import Cell, find_move, move_name, parse_move  # tests and users import these from here too
from tinkerless.errors import EnvError

BLACK = "black"
WHITE = "white"
ROLES: tuple[str, str] = (BLACK, WHITE)
SYMBOLS: dict[str | None, str] = {BLACK: "X", WHITE: "O", None: "."}
MAX_SIZE = 26  # one letter per column
# Right, down, and the two diagonals: every line is covered by one of these and its reverse.
DIRECTIONS: tuple[tuple[int, int], ...] = ((0, 1), (1, 0), (1, 1), (1, -1))


def other(role: str) -> str:
    return WHITE if role == BLACK else BLACK


@dataclass
class Board:
    """An n×n board; `win_length` stones in a row (any direction) win."""

    size: int = 7
    win_length: int = 4
    cells: list[list[str | None]] = field(default_factory=list)
    moves: list[tuple[str, int, int]] = field(default_factory=list)  # (stone, row, col) in play order

    def __post_init__(self) -> None:
        if not (isinstance(self.size, int) and isinstance(self.win_length, int)):
            raise EnvError(
                f"gomoku size and win_length must be integers, got {self.size!r} and {self.win_length!r}",
                hint="pass e.g. reset(size=7, win_length=4)",
            )
        if not 2 <= self.win_length <= self.size <= MAX_SIZE:
            raise EnvError(
                f"gomoku needs 2 <= win_length <= size <= {MAX_SIZE}, got size={self.size}, "
                f"win_length={self.win_length}",
                hint="use e.g. size=7, win_length=4 (CPU-friendly) or size=15, win_length=5 (classic)",
            )
        if not self.cells:
            self.cells = [[None] * self.size for _ in range(self.size)]

    def on_board(self, row: int, col: int) -> bool:
        return 0 <= row < self.size and 0 <= col < self.size

    def is_legal(self, row: int, col: int) -> bool:
        return self.on_board(row, col) and self.cells[row][col] is None

    def legal_moves(self) -> list[Cell]:
        """Empty cells in row-major order (a stable order keeps seeded play reproducible)."""
        return [(r, c) for r in range(self.size) for c in range(self.size) if self.cells[r][c] is None]

    def place(self, row: int, col: int, stone: str) -> None:
        if stone not in ROLES:
            raise EnvError(f"unknown stone {stone!r}", hint=f"use one of {ROLES}")
        if not self.is_legal(row, col):
            where = "off the board" if not self.on_board(row, col) else "already taken"
            raise EnvError(
                f"cannot place {stone} at row {row}, col {col}: {where}",
                hint="check board.is_legal(row, col) before placing",
            )
        self.cells[row][col] = stone
        self.moves.append((stone, row, col))

    def _run(self, row: int, col: int, stone: str, dr: int, dc: int) -> int:
        """How many `stone`s follow (row, col) in direction (dr, dc), not counting the cell itself."""
        count = 0
        r, c = row + dr, col + dc
        while self.on_board(r, c) and self.cells[r][c] == stone:
            count += 1
            r, c = r + dr, c + dc
        return count

    def line_through(self, row: int, col: int, stone: str) -> int:
        """Longest line of `stone` through (row, col), counting that cell as `stone` (even if empty)."""
        return max(1 + self._run(row, col, stone, dr, dc) + self._run(row, col, stone, -dr, -dc) for dr, dc in DIRECTIONS)

    def wins_at(self, row: int, col: int, stone: str) -> bool:
        """Would (or did) `stone` at (row, col) complete a winning line?"""
        return self.line_through(row, col, stone) >= self.win_length

    def winner(self) -> str | None:
        """The stone with `win_length` in a row anywhere on the board, else None (full scan)."""
        for r in range(self.size):
            for c in range(self.size):
                stone = self.cells[r][c]
                if stone is None:
                    continue
                for dr, dc in DIRECTIONS:
                    # Count only forward runs starting here; every line has a first cell.
                    if 1 + self._run(r, c, stone, dr, dc) >= self.win_length:
                        return stone
        return None

    def is_full(self) -> bool:
        return all(cell is not None for row in self.cells for cell in row)

    def render(self) -> str:
        """Compact grid with column letters and row numbers, then the move list."""
        width = len(str(self.size))
        header = " " * (width + 1) + " ".join(chr(ord("a") + c) for c in range(self.size))
        lines = [header]
        for r in range(self.size):
            lines.append(f"{r + 1:>{width}} " + " ".join(SYMBOLS[cell] for cell in self.cells[r]))
        history = ", ".join(f"{SYMBOLS[s]} {move_name(r, c)}" for s, r, c in self.moves)
        lines.append(f"Moves: {history}" if history else "Moves: none yet")
        return "\n".join(lines)


# --- the env --------------------------------------------------------------


class GomokuEnv:
    """Two-player gomoku. Configure with `reset(size=, win_length=, max_invalid=, invalid_penalty=)`,
    or override the `default_*` class attributes in a subclass.

    Rewards: each invalid answer (no move found, off-board, occupied) costs that agent
    `invalid_penalty` and it answers again; its `max_invalid`-th invalid answer in a game
    forfeits it. The final step adds the zero-sum outcome for both roles:
    +1/-1 for a win (or forfeit), 0/0 for a draw (full board).
    """

    agents: tuple[str, ...] = ROLES
    default_size: int = 7
    default_win_length: int = 4
    default_max_invalid: int = 3
    default_invalid_penalty: float = -0.1
    # Show empty cells by number (and accept "move: 7"): small models copy numbers far more
    # reliably than "c3"-style names. Coordinates are accepted either way.
    numbered_cells: bool = True

    def __init__(self) -> None:
        self.reset()

    def reset(
        self,
        size: int | None = None,
        win_length: int | None = None,
        max_invalid: int | None = None,
        invalid_penalty: float | None = None,
        **_other_task_fields: Any,  # dataset rows may carry ids/metadata; they do not configure the game
    ) -> None:
        self.board = Board(
            size=self.default_size if size is None else size,
            win_length=self.default_win_length if win_length is None else win_length,
        )
        self.max_invalid = self.default_max_invalid if max_invalid is None else max_invalid
        if not isinstance(self.max_invalid, int) or self.max_invalid < 1:
            raise EnvError(
                f"max_invalid must be a positive integer, got {self.max_invalid!r}",
                hint="use max_invalid=1 to forfeit on the first invalid answer, 3 to allow two retries",
            )
        self.invalid_penalty = float(self.default_invalid_penalty if invalid_penalty is None else invalid_penalty)
        self.invalid: dict[str, int] = {role: 0 for role in ROLES}
        self.last_error: dict[str, str | None] = {role: None for role in ROLES}
        self.to_move: str | None = BLACK
        self.winner: str | None = None  # "black" / "white" / "draw" once over
        self.forfeit: str | None = None

    # -- protocol ----------------------------------------------------------

    def turn(self) -> str | None:
        return self.to_move

    def response_prefix(self, agent: str) -> str:
        """The coordinator starts each reply with this, so the model only has to name the cell."""
        return "move: "

    def system_prompt(self, agent: str) -> str:
        self._check_role(agent)
        b = self.board
        return (
            f"You are playing gomoku as {agent} ({SYMBOLS[agent]}) on a {b.size}x{b.size} board. "
            f"Players take turns placing one stone on an empty cell; black moves first. "
            f"The first to get {b.win_length} stones in a row horizontally, vertically or diagonally wins; "
            f"a full board is a draw. Columns are letters a-{chr(ord('a') + b.size - 1)}, rows are numbers "
            f"1-{b.size}. Answer with a single move such as \"move: {self._example()}\". "
            f"Invalid answers (unreadable, off the board, or on a taken cell) are penalized, and "
            f"{self.max_invalid} of them in one game forfeit it."
        )

    def observation(self, agent: str) -> str:
        self._check_role(agent)
        b = self.board
        opponent = other(agent)
        last = next(((r, c) for s, r, c in reversed(b.moves) if s == opponent), None)
        lines = [
            f"Gomoku {b.size}x{b.size}: {b.win_length} in a row wins.",
            f"You play {agent} ({SYMBOLS[agent]}); your opponent plays {opponent} ({SYMBOLS[opponent]}).",
            f"Opponent's last move: {move_name(*last)}." if last else "Your opponent has not moved yet.",
        ]
        if self.last_error[agent]:
            left = self.max_invalid - self.invalid[agent]
            lines.append(f"Your previous answer was invalid: {self.last_error[agent]} ({left} invalid answers left before you forfeit).")
        lines.append(b.render())
        # Listing the free cells right before the answer lets a small model copy a legal move.
        if self.numbered_cells:
            lines.append("Free cells: " + " ".join(str(r * b.size + c + 1) for r, c in b.legal_moves()))
            lines.append('Answer with one move: "move: <free cell number>", or a coordinate like "move: b2".')
        else:
            lines.append("Free cells: " + " ".join(move_name(r, c) for r, c in b.legal_moves()))
            lines.append(f'Answer with one move: "move: <column letter><row number>", e.g. "move: {self._example()}".')
        return "\n".join(lines)

    def step(self, agent: str, action: str) -> MultiStepResult:
        self._check_role(agent)
        if self.to_move is None:
            raise EnvError("the gomoku game is already over", hint="stop stepping once turn() returns None")
        if agent != self.to_move:
            raise EnvError(
                f"it is {self.to_move}'s turn, not {agent}'s",
                hint="call step() only for the agent that turn() names",
            )
        rewards = {role: 0.0 for role in ROLES}
        error = self._invalid_reason(str(action))
        if error is not None:
            self.invalid[agent] += 1
            self.last_error[agent] = error
            rewards[agent] += self.invalid_penalty
            if self.invalid[agent] >= self.max_invalid:
                self.forfeit = agent
                return self._finish(other(agent), rewards)
            return MultiStepResult(rewards=rewards, done=False, info=self._info(error=error))

        row, col = self._parse(str(action))  # type: ignore[misc]  # valid per _invalid_reason
        self.board.place(row, col, agent)
        self.last_error[agent] = None
        if self.board.wins_at(row, col, agent):
            return self._finish(agent, rewards)
        if self.board.is_full():
            return self._finish("draw", rewards)
        self.to_move = other(agent)
        return MultiStepResult(rewards=rewards, done=False, info=self._info())

    # -- helpers -----------------------------------------------------------

    def _check_role(self, agent: str) -> None:
        if agent not in ROLES:
            raise EnvError(f"unknown gomoku role {agent!r}", hint=f"roles are {ROLES}")

    def _example(self) -> str:
        center = self.board.size // 2
        return move_name(center, center)

    def _parse(self, action: str) -> Cell | None:
        return parse_move(action, self.board.size, cell_numbers=self.numbered_cells)

    def _invalid_reason(self, action: str) -> str | None:
        size = self.board.size
        cell = self._parse(action)
        if cell is None:
            found = find_move(action)
            if found is None:
                return f'no move found in the answer; write e.g. "move: {self._example()}"'
            return f"row {found[0]}, column {found[1]} is off the {size}x{size} board"
        row, col = cell
        if self.board.cells[row][col] is not None:
            return f"{move_name(row, col)} is already taken"
        return None

    def _finish(self, winner: str, rewards: dict[str, float]) -> MultiStepResult:
        self.winner = winner
        self.to_move = None
        outcome = self.outcome()
        for role in ROLES:
            rewards[role] += outcome[role]
        return MultiStepResult(rewards=rewards, done=True, info=self._info())

    def outcome(self) -> dict[str, float]:
        """Zero-sum terminal rewards (penalties excluded); all zeros while the game runs or on a draw."""
        if self.winner in ROLES:
            return {self.winner: 1.0, other(self.winner): -1.0}
        return {role: 0.0 for role in ROLES}

    def _info(self, error: str | None = None) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "moves": len(self.board.moves),
            "invalid": dict(self.invalid),
            "forfeit": self.forfeit,
            "outcome": self.outcome(),
            "history": [move_name(r, c) for _, r, c in self.board.moves],
            "error": error,
        }


# --- opponents that need no model ------------------------------------------

Opponent = Callable[[GomokuEnv, str, random.Random], str]


def random_opponent(env: GomokuEnv, agent: str, rng: random.Random) -> str:
    """A uniformly random legal move, as text like "d4"."""
    moves = env.board.legal_moves()
    if not moves:
        raise EnvError("no legal moves left on the board", hint="only ask for a move while turn() is not None")
    return move_name(*rng.choice(moves))


def greedy_opponent(env: GomokuEnv, agent: str, rng: random.Random) -> str:
    """Win now if possible, else block the opponent's immediate win, else extend its own
    longest line next to its own stones (ties broken at random), else a random move."""
    board = env.board
    moves = board.legal_moves()
    if not moves:
        raise EnvError("no legal moves left on the board", hint="only ask for a move while turn() is not None")
    for stone in (agent, other(agent)):  # own win first, then the block
        hits = [m for m in moves if board.wins_at(*m, stone)]
        if hits:
            return move_name(*rng.choice(hits))
    near = [m for m in moves if _touches(board, *m, agent)]
    if near:
        best = max(board.line_through(*m, agent) for m in near)
        return move_name(*rng.choice([m for m in near if board.line_through(*m, agent) == best]))
    return move_name(*rng.choice(moves))


def _touches(board: Board, row: int, col: int, stone: str) -> bool:
    """Is one of the 8 neighbours of (row, col) a `stone`?"""
    return any(
        board.on_board(row + dr, col + dc) and board.cells[row + dr][col + dc] == stone
        for dr in (-1, 0, 1)
        for dc in (-1, 0, 1)
        if dr or dc
    )


def play_game(
    env: GomokuEnv,
    players: dict[str, Opponent],
    rng: random.Random,
) -> tuple[dict[str, float], dict[str, Any]]:
    """Play a reset env to the end with `players[role](env, role, rng)`; returns summed rewards and the last info."""
    totals = {role: 0.0 for role in ROLES}
    info: dict[str, Any] = {}
    while (agent := env.turn()) is not None:
        result = env.step(agent, players[agent](env, agent, rng))
        for role, value in result.rewards.items():
            totals[role] += value
        info = result.info
    return totals, info
