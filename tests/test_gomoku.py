"""Gomoku: board rules, move parsing, the multi-agent protocol, rewards and the built-in opponents."""

from __future__ import annotations

import random

import pytest

from tinkerless.envs.base import MultiStepResult, is_multi_agent
from tinkerless.envs.gomoku import (
    BLACK,
    WHITE,
    Board,
    GomokuEnv,
    greedy_opponent,
    move_name,
    parse_move,
    play_game,
    random_opponent,
)
from tinkerless.errors import EnvError
from tinkerless.wire import pack_code, unpack_code


def board_with(size: int, k: int, black: list[tuple[int, int]] = (), white: list[tuple[int, int]] = ()) -> Board:
    board = Board(size=size, win_length=k)
    for r, c in black:
        board.place(r, c, BLACK)
    for r, c in white:
        board.place(r, c, WHITE)
    return board


# --- board -------------------------------------------------------------------


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 3), (0, 4), (0, 5), (0, 6)],  # horizontal, top edge, touching the right edge
        [(3, 6), (4, 6), (5, 6), (6, 6)],  # vertical, right edge, touching the bottom
        [(3, 3), (4, 4), (5, 5), (6, 6)],  # main diagonal ending in the corner
        [(0, 6), (1, 5), (2, 4), (3, 3)],  # anti-diagonal from the top-right corner
        [(6, 0), (5, 1), (4, 2), (3, 3)],  # anti-diagonal from the bottom-left corner
        [(6, 0), (6, 1), (6, 2), (6, 3)],  # horizontal, bottom-left
    ],
)
def test_winner_in_every_direction_at_edges(cells):
    board = board_with(7, 4, black=cells)
    assert board.winner() == BLACK
    assert all(board.wins_at(r, c, BLACK) for r, c in cells)
    white = board_with(7, 4, white=cells)
    assert white.winner() == WHITE


@pytest.mark.parametrize(
    "cells",
    [
        [(0, 4), (0, 5), (0, 6), (1, 0)],  # no wrap-around from row end to next row start
        [(0, 0), (0, 1), (0, 2), (0, 4)],  # gap
        [(4, 6), (5, 6), (6, 6), (0, 6)],  # no vertical wrap
        [(4, 4), (5, 5), (6, 6), (0, 0)],  # no diagonal wrap
        [(0, 6), (1, 5), (2, 4), (3, 2)],  # broken anti-diagonal
    ],
)
def test_no_false_positive(cells):
    board = board_with(7, 4, black=cells)
    assert board.winner() is None


def test_mixed_colors_do_not_make_a_line():
    board = board_with(5, 4, black=[(2, 0), (2, 1), (2, 3)], white=[(2, 2)])
    assert board.winner() is None


def test_full_board_without_a_line_is_a_draw():
    # 3x3 with k=3: X O X / X O O / O X X has no three in a row.
    layout = ["XOX", "XOO", "OXX"]
    board = Board(size=3, win_length=3)
    for r, line in enumerate(layout):
        for c, ch in enumerate(line):
            board.place(r, c, BLACK if ch == "X" else WHITE)
    assert board.is_full()
    assert board.winner() is None


def test_place_rejects_taken_and_off_board():
    board = board_with(5, 4, black=[(1, 1)])
    assert not board.is_legal(1, 1) and not board.is_legal(5, 0) and not board.is_legal(-1, 0)
    with pytest.raises(EnvError, match="already taken"):
        board.place(1, 1, WHITE)
    with pytest.raises(EnvError, match="off the board"):
        board.place(0, 5, WHITE)


def test_bad_board_config_says_what_to_use():
    with pytest.raises(EnvError, match="win_length <= size") as err:
        Board(size=3, win_length=4)
    assert err.value.hint


def test_render_has_coordinates_and_moves():
    board = board_with(7, 4, black=[(3, 3)], white=[(2, 2)])
    text = board.render()
    lines = text.splitlines()
    assert lines[0].split() == list("abcdefg")
    assert lines[4].split() == ["4", ".", ".", ".", "X", ".", ".", "."]
    assert lines[3].split()[3] == "O"
    assert lines[-1] == "Moves: X d4, O c3"


# --- parsing -----------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("d4", (3, 3)),
        ("D4", (3, 3)),
        ("I'll play c2 now.", (1, 2)),
        ("row 4 col 3", (3, 2)),
        ("Row 4, column 3", (3, 2)),
        ("row 4 column d", (3, 3)),
        ("column 3 row 4", (3, 2)),
        ("(4, 3)", (3, 2)),
        ("( 1 ,7 )", (0, 6)),
        ("a1 or b2", (0, 0)),  # first mention wins
        ("Thinking about b2 and c3... move: e5", (4, 4)),  # marker: only text after it counts
        ("move: d4. Then later maybe e5. Move: a1", (0, 0)),  # last marker
        ("g7", (6, 6)),
    ],
)
def test_parse_move_accepts(text, expected):
    assert parse_move(text, 7) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "pass",
        "4d",  # number-then-letter is deliberately not accepted
        "h1",  # column off a 7x7 board
        "a8",  # row off the board
        "a0",
        "(0, 3)",
        "row 9 col 1",
        "data1",  # a letter+digit inside a word is not a move
    ],
)
def test_parse_move_rejects(text):
    assert parse_move(text, 7) is None


def test_parse_move_uses_first_mention_even_if_off_board():
    assert parse_move("z9 then a1", 7) is None
    assert parse_move("move: pass", 7) is None
    assert parse_move("a1 ... move: pass", 7) is None


def test_move_name_round_trips():
    for r in range(7):
        for c in range(7):
            assert parse_move(move_name(r, c), 7) == (r, c)


# --- env protocol ------------------------------------------------------------


def test_protocol_shape():
    assert is_multi_agent(GomokuEnv)
    assert GomokuEnv.agents == ("black", "white")
    env = GomokuEnv()
    env.reset()
    assert env.turn() == BLACK
    assert "black" in env.system_prompt(BLACK) and "4 stones in a row" in env.system_prompt(BLACK)


def test_turns_alternate_and_stay_on_invalid():
    env = GomokuEnv()
    env.reset(size=5, win_length=4)
    assert env.step(BLACK, "move: c3").rewards == {BLACK: 0.0, WHITE: 0.0}
    assert env.turn() == WHITE
    result = env.step(WHITE, "c3")  # occupied
    assert env.turn() == WHITE and not result.done
    assert result.rewards == {BLACK: 0.0, WHITE: -0.1}
    assert result.info["invalid"] == {BLACK: 0, WHITE: 1}
    assert "already taken" in env.observation(WHITE)
    env.step(WHITE, "b2")
    assert env.turn() == BLACK
    with pytest.raises(EnvError, match="turn"):
        env.step(WHITE, "a1")


def test_observation_shows_role_last_move_board_and_format():
    env = GomokuEnv()
    env.reset()
    first = env.observation(BLACK)
    assert "You play black (X)" in first and "has not moved yet" in first
    env.step(BLACK, "d4")
    obs = env.observation(WHITE)
    assert "You play white (O)" in obs
    assert "Opponent's last move: d4." in obs
    assert "Moves: X d4" in obs
    assert obs.splitlines()[-1].startswith('Answer with one move: "move: <free cell number>"')
    assert obs.splitlines()[-2].startswith("Free cells: ") and " 25 " not in obs.splitlines()[-2] + " "  # d4 = cell 25 on 7x7


def test_penalty_and_forfeit_after_max_invalid():
    env = GomokuEnv()
    env.reset(size=5, win_length=4, max_invalid=3, invalid_penalty=-0.25)
    env.step(BLACK, "a1")
    totals = {BLACK: 0.0, WHITE: 0.0}
    for attempt in range(3):
        assert env.turn() == WHITE
        result = env.step(WHITE, ["nope", "z9", "a1"][attempt])
        for role, value in result.rewards.items():
            totals[role] += value
    assert result.done and env.turn() is None
    assert result.info["winner"] == BLACK and result.info["forfeit"] == WHITE
    assert result.info["invalid"] == {BLACK: 0, WHITE: 3}
    assert result.rewards == {BLACK: 1.0, WHITE: -1.25}
    assert totals == {BLACK: 1.0, WHITE: pytest.approx(-1.75)}
    with pytest.raises(EnvError, match="already over"):
        env.step(BLACK, "b2")


def test_win_ends_game_with_zero_sum_rewards():
    env = GomokuEnv()
    env.reset(size=5, win_length=3)
    for agent, move in [(BLACK, "a1"), (WHITE, "a5"), (BLACK, "b2"), (WHITE, "b5")]:
        assert not env.step(agent, move).done
    result = env.step(BLACK, "c3")
    assert result.done and env.turn() is None
    assert result.rewards == {BLACK: 1.0, WHITE: -1.0}
    assert result.info["winner"] == BLACK and result.info["moves"] == 5


def test_full_board_is_a_draw_for_the_env():
    env = GomokuEnv()
    env.reset(size=3, win_length=3)
    # Fills XOX / XOO / OXX in alternating order without a line.
    order = ["a1", "b1", "c1", "b2", "a2", "c2", "b3", "a3", "c3"]
    for i, move in enumerate(order):
        result = env.step(env.turn(), move)
        assert result.done == (i == len(order) - 1)
    assert result.info["winner"] == "draw"
    assert result.rewards == {BLACK: 0.0, WHITE: 0.0}


def test_reset_config_validation_and_extra_task_fields():
    env = GomokuEnv()
    env.reset(size=9, win_length=5, task_id="t-1")  # unrelated task fields are ignored
    assert env.board.size == 9 and env.board.win_length == 5
    with pytest.raises(EnvError, match="max_invalid"):
        env.reset(max_invalid=0)
    with pytest.raises(EnvError, match="unknown gomoku role"):
        env.observation("red")


# --- many games --------------------------------------------------------------


def noisy_random(env: GomokuEnv, agent: str, rng: random.Random) -> str:
    """Random moves with some garbage answers, to exercise penalties and forfeits."""
    return "I pass" if rng.random() < 0.15 else random_opponent(env, agent, rng)


@pytest.mark.parametrize("player", [random_opponent, noisy_random])
def test_zero_sum_over_many_random_games(player):
    rng = random.Random(1234)
    outcomes = set()
    for _ in range(200):
        env = GomokuEnv()
        env.reset(size=5, win_length=4)
        totals, info = play_game(env, {BLACK: player, WHITE: player}, rng)
        # Strip the penalties; what remains is the terminal zero-sum outcome.
        terminal = {role: totals[role] - env.invalid_penalty * info["invalid"][role] for role in totals}
        assert terminal[BLACK] + terminal[WHITE] == pytest.approx(0.0)
        pair = (round(terminal[BLACK], 9), round(terminal[WHITE], 9))
        assert pair in {(1.0, -1.0), (-1.0, 1.0), (0.0, 0.0)}
        assert pair == (info["outcome"][BLACK], info["outcome"][WHITE])
        outcomes.add(info["winner"])
    assert {BLACK, WHITE} <= outcomes


def test_greedy_beats_random():
    rng = random.Random(7)
    wins = 0
    for game in range(50):
        greedy_role = BLACK if game % 2 == 0 else WHITE
        players = {greedy_role: greedy_opponent, ("white" if greedy_role == BLACK else "black"): random_opponent}
        env = GomokuEnv()
        env.reset()
        _, info = play_game(env, players, rng)
        wins += info["winner"] == greedy_role
    assert wins > 40, f"greedy won only {wins}/50"


def test_greedy_wins_and_blocks():
    env = GomokuEnv()
    env.reset(size=7, win_length=4)
    for agent, move in [(BLACK, "a1"), (WHITE, "g7"), (BLACK, "a2"), (WHITE, "f7"), (BLACK, "a3")]:
        env.step(agent, move)
    rng = random.Random(0)
    assert greedy_opponent(env, WHITE, rng) == "a4"  # block black's a1-a3
    env.step(WHITE, "e7")  # white now threatens d7 instead of blocking
    assert greedy_opponent(env, BLACK, rng) == "a4"  # take the win rather than block d7
    assert env.step(BLACK, "a4").info["winner"] == BLACK


def test_deterministic_for_a_seed():
    def run(seed: int) -> tuple[list[str], dict[str, float]]:
        env = GomokuEnv()
        env.reset(size=6, win_length=4)
        totals, info = play_game(env, {BLACK: greedy_opponent, WHITE: noisy_random}, random.Random(seed))
        return info["history"], totals

    assert run(3) == run(3)
    assert run(3) != run(4)


# --- shipping ----------------------------------------------------------------


class SmallGomoku(GomokuEnv):
    default_size = 5
    default_win_length = 3


@pytest.mark.parametrize("cls", [GomokuEnv, SmallGomoku])
def test_env_class_survives_cloudpickle(cls):
    rebuilt = unpack_code(pack_code(cls))
    assert is_multi_agent(rebuilt)
    env = rebuilt()
    env.reset()
    assert env.board.size == cls.default_size
    result = env.step(env.turn(), "move: b2")
    assert isinstance(result, MultiStepResult)
    assert env.turn() == WHITE


def test_numbered_cells_are_parsed_row_by_row():
    assert parse_move("move: 7", 4, cell_numbers=True) == (1, 2)
    assert parse_move("move: 1 . . .", 4, cell_numbers=True) == (0, 0)
    assert parse_move("move: 16", 4, cell_numbers=True) == (3, 3)
    assert parse_move("move: 17", 4, cell_numbers=True) is None
    assert parse_move("move: b2", 4, cell_numbers=True) == (1, 1)  # coordinates still work
    assert parse_move("move: 7", 4) is None  # numbers only when the board is numbered


def test_numbered_cell_move_is_played_and_taken_cells_are_refused():
    env = GomokuEnv()
    env.reset(size=4, win_length=3)
    env.step(BLACK, "move: 6")
    assert env.board.cells[1][1] == BLACK
    result = env.step(WHITE, "move: 6")
    assert result.rewards[WHITE] < 0 and env.turn() == WHITE
    assert "already taken" in env.observation(WHITE)
