"""Gomoku moves as text: reading a move from a model's free-text answer, and naming a cell.

Coordinates: columns are letters a.. (left to right), rows are numbers 1..n
(top to bottom, as rendered). Internally a cell is a 0-based `(row, col)` pair.

Move format accepted by `parse_move` (case-insensitive):
- "d4": column letter then row number (the canonical form the env asks for);
- "row 4 col 3" / "row 4, column d" / "column 3 row 4";
- "(4, 3)": 1-based (row, col).
"4d" (number then letter) is NOT accepted: numbers followed by letters are common
in prose ("2x", "3rd") and would be misread as moves.
If the text contains a "move:" marker, only the text after the LAST marker is
searched (so reasoning before a final "move: d4" is ignored); the FIRST
well-formed move found there is the answer. If that move is off the board the
answer is invalid (None) -- later mentions are not tried.

The board, the env and the opponents are in `tinkerless.envs.gomoku`, which
re-exports `Cell`, `move_name`, `find_move` and `parse_move`.
"""

from __future__ import annotations

import re

Cell = tuple[int, int]


def move_name(row: int, col: int) -> str:
    """0-based (row, col) -> canonical text, e.g. (3, 3) -> "d4"."""
    return f"{chr(ord('a') + col)}{row + 1}"


# --- reading a move from text ----------------------------------------------

_MARKER = re.compile(r"\bmove\s*:", re.IGNORECASE)
_NUM = r"(\d{1,2})"
_COL = r"(\d{1,2}|[a-z])(?![a-z0-9])"
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # "d4": a lone letter glued to a number, not part of a longer word or number.
    (re.compile(r"(?<![a-z0-9])([a-z])" + _NUM + r"(?![a-z0-9])", re.IGNORECASE), "letter_row"),
    (re.compile(r"\brow\s*" + _NUM + r"\s*[,;]?\s*(?:and\s+)?col(?:umn)?\s*" + _COL, re.IGNORECASE), "row_col"),
    (re.compile(r"\bcol(?:umn)?\s*" + _COL + r"\s*[,;]?\s*(?:and\s+)?row\s*" + _NUM + r"\b", re.IGNORECASE), "col_row"),
    (re.compile(r"\(\s*" + _NUM + r"\s*,\s*" + _NUM + r"\s*\)"), "tuple"),
)


def _column_number(token: str) -> int:
    """1-based column from "3" or "c"."""
    return int(token) if token.isdigit() else ord(token.lower()) - ord("a") + 1


def find_move(text: str) -> tuple[int, int] | None:
    """The first well-formed move in `text` (after the last "move:" marker) as 1-based (row, col), unchecked."""
    markers = list(_MARKER.finditer(text))
    if markers:
        text = text[markers[-1].end():]
    best: tuple[int, int, int] | None = None  # (start, row, col)
    for pattern, kind in _PATTERNS:
        match = pattern.search(text)
        if match is None or (best is not None and match.start() >= best[0]):
            continue
        a, b = match.group(1), match.group(2)
        if kind == "letter_row":
            row, col = int(b), _column_number(a)
        elif kind == "col_row":
            row, col = int(b), _column_number(a)
        else:  # row_col, tuple
            row, col = int(a), _column_number(b)
        best = (match.start(), row, col)
    return None if best is None else (best[1], best[2])


_CELL_NUMBER = re.compile(r"^\s*(\d{1,3})(?!\d)")


def parse_move(text: str, size: int, *, cell_numbers: bool = False) -> Cell | None:
    """A move from free text as a 0-based (row, col), or None if absent or off a size×size board.

    With `cell_numbers`, a reply (after its last "move:") that starts with a number
    names the cell counted row by row from 1, as shown on a numbered board.
    """
    if cell_numbers:
        marks = list(_MARKER.finditer(text))
        tail = text[marks[-1].end():] if marks else text
        number = _CELL_NUMBER.match(tail)
        if number and find_move(tail[: number.end()]) is None:
            index = int(number.group(1)) - 1
            return divmod(index, size) if 0 <= index < size * size else None
    found = find_move(text)
    if found is None:
        return None
    row, col = found[0] - 1, found[1] - 1
    if not (0 <= row < size and 0 <= col < size):
        return None
    return row, col
