"""TextArena games as tinkerless envs: a game's players become the roles (seats) of a multi-agent env.

    TicTacToe = tinkerless.envs.textarena("TicTacToe-v0")          # roles ("player_0", "player_1")
    tinkerless.train(env=TicTacToe, tasks=TicTacToe.tasks, agents=tinkerless.self_play(TicTacToe.agents), ...)

TextArena player `i` is the role `player_i`; who moves is the game's `current_player_id`. Every seat form works:
a trained policy (self-play: one policy in every role), `tinkerless.Frozen()` / `Frozen(adapter_dir)`, a scripted
`opponent(env, role, rng) -> str` (`random_opponent` plays a uniformly random valid move), and `round_robin`.
A one-player game is a single-agent env instead (`reset(seed) -> str`, `step(text) -> StepResult`).

Each turn the player sees what reached it since its previous turn (the game's messages and the other players'
moves; the first turn also the game's prompt), as one user message: TextArena's observations are incremental,
so the conversation grows as the game goes. The game is made with its `-raw` id (no wrappers), since the
default wrappers repeat the whole history every turn.

Invalid moves: the game decides (its own error allowance, then a loss, as its rules say); the adapter sees one
by the player's error count going up (the current player does not advance) and adds `invalid_penalty` to that
player's reward at that step. The final rewards are the game's own, per player (`env.close()`).

TextArena's games reseed and draw from Python's global `random`; each game here keeps its own generator state
(swapped in around every call into the library), so games played side by side stay reproducible per seed.

Refused, with the reason: games whose code needs Python 3.12, games that call an online LLM (an API key and the
network), and word games whose NLTK corpora are not installed (no PyPI package ships them; docs say how to
install them by hand).
"""

from __future__ import annotations

import copy
import random
import re
import sys
from contextlib import contextmanager
from typing import Any, Iterator

from tinkerless.envs.adapters._optional import require
from tinkerless.envs.base import MultiStepResult, StepResult
from tinkerless.errors import ConfigError, EnvError

# Games that need a hosted LLM (an OpenRouter key and the network) for a juror or game master.
NEEDS_NETWORK = {"Debate", "ScenarioPlanning", "TwentyQuestions", "GuessWho"}
# Word games and the NLTK data they read (`scripts/install.sh` fetches it where NLTK's data server is reachable).
TAGGER = "taggers/averaged_perceptron_tagger_eng"  # the part-of-speech tagger three of them filter words with
NEEDS_NLTK = {
    "Codenames": ["corpora/words", TAGGER], "DontSayIt": ["corpora/words", TAGGER], "Hangman": ["corpora/words"],
    "LetterAuction": ["corpora/words"], "SpellingBee": ["corpora/words"], "WordChains": ["corpora/words"],
    "WordLadder": ["corpora/words"], "WordSearch": ["corpora/words"], "Wordle": ["corpora/words", TAGGER],
}
PLAYER_COUNTS = (2, 1, 3, 4, 5, 6)  # tried in this order when the game's count is not given
BRACKETED = re.compile(r"\[[^\[\]\n]{1,40}\]")


def textarena(env_id: str, *, num_players: int | None = None, invalid_penalty: float = -0.1,
              response_prefix: str = "", **game_kwargs: Any) -> type:
    """An env class for TextArena's `env_id` (module docstring); `game_kwargs` go to the game's constructor."""
    ta = require("textarena")
    if not isinstance(env_id, str) or not env_id:
        raise ConfigError(f"textarena takes a game id such as 'TicTacToe-v0', got {env_id!r}")
    base_id = re.sub(r"-(raw|train)$", "", env_id)
    registry = require("textarena.envs.registration").ENV_REGISTRY
    if base_id + "-raw" not in registry:
        close = sorted(i for i in registry if i.split("-")[0].lower() == base_id.split("-")[0].lower())[:6]
        raise ConfigError(f"TextArena has no game {env_id!r}", hint=f"ids of that game: {close}" if close else "see textarena.envs.registration.ENV_REGISTRY")
    _refuse_unrunnable(base_id, registry[base_id + "-raw"])
    if isinstance(invalid_penalty, bool) or not isinstance(invalid_penalty, (int, float)):
        raise ConfigError(f"invalid_penalty must be a number, got {invalid_penalty!r}")
    players = num_players if num_players is not None else _player_count(ta, base_id, game_kwargs)
    if not isinstance(players, int) or isinstance(players, bool) or players < 1:
        raise ConfigError(f"num_players must be a positive integer, got {players!r}")
    attributes = {
        "env_id": base_id + "-raw", "num_players": players, "game_kwargs": dict(game_kwargs),
        "invalid_penalty": float(invalid_penalty), "prefix": str(response_prefix),
        "__doc__": f"TextArena {base_id} ({players} player{'s' if players > 1 else ''}), adapted by tinkerless.envs.textarena",
    }
    name = re.sub(r"\W", "_", base_id)
    if players == 1:
        return type(name, (TextArenaSinglePlayer,), attributes)
    attributes["agents"] = tuple(f"player_{i}" for i in range(players))
    return type(name, (TextArenaGame,), attributes)


def tasks(rng: random.Random) -> dict:
    """A game per seed: the task function `train(tasks=...)` takes for any TextArena env."""
    return {"seed": rng.randrange(2**31)}


class _TextArenaEnv:
    """What both adapters share: the game object, its own random state, the rendering of its observations."""

    env_id: str = ""
    num_players: int = 2
    game_kwargs: dict = {}
    invalid_penalty: float = -0.1
    prefix: str = ""
    tasks = staticmethod(tasks)

    def __init__(self) -> None:
        self.game: Any = None
        self.done = True
        self._random = random.Random(0).getstate()

    def _new_game(self, seed: int | None) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise EnvError(f"a TextArena task's seed must be an integer, got {seed!r}")
        ta = require("textarena")
        self._random = random.Random(seed).getstate()
        with self._own_random():
            self.game = ta.make(self.env_id, **self.game_kwargs)
            self.game.reset(num_players=self.num_players, seed=seed)
        self.done = False
        self.errors = [0] * self.num_players
        self.seen: dict[int, list[str]] = {i: [] for i in range(self.num_players)}  # what each player was shown

    @contextmanager
    def _own_random(self) -> Iterator[None]:
        """The game's generator in place of the process's global one for the length of one library call."""
        outside = random.getstate()
        random.setstate(self._random)
        try:
            yield
        finally:
            self._random = random.getstate()
            random.setstate(outside)

    def _current(self) -> int:
        return int(self.game.state.current_player_id)

    def _error_count(self) -> int:
        return int(getattr(self.game.state, "error_count", 0) or 0)

    def _pending(self, player: int) -> str:
        """The messages that reached `player` since its last turn, as text (its own moves left out)."""
        with self._own_random():
            current, messages = self.game.get_observation()
        if int(current) != player:
            raise EnvError(f"TextArena {self.env_id} gave player {current}'s observation when player {player} was to move")
        text = _render(messages, player, self.game.state)
        self.seen[player].append(text)
        return text

    def _play(self, player: int, action: str) -> tuple[bool, bool]:
        """Play `action` for `player`: (done, invalid). An invalid move raised the player's error count, or ended
        the game with the player marked invalid; the player does not advance."""
        errors_before = self._error_count()
        with self._own_random():
            done, _info = self.game.step(str(action))
        done = bool(done)
        invalid = self._error_count() > errors_before
        if done:
            game_info = getattr(self.game.state, "game_info", {}) or {}
            invalid = invalid or bool((game_info.get(player) or {}).get("invalid_move"))
        if invalid:
            self.errors[player] += 1
        return done, invalid

    def _final_rewards(self) -> tuple[dict[int, float], dict]:
        with self._own_random():
            closed = self.game.close()
        rewards, game_info = (closed if isinstance(closed, tuple) and len(closed) == 2 else (closed, {}))
        rewards = rewards or {}
        return {i: rewards.get(i, 0.0) for i in range(self.num_players)}, game_info or {}

    def valid_moves(self, player: int) -> list[str]:
        """The bracketed moves this player was shown (e.g. "[4]") that the game accepts now, each tried on a copy."""
        candidates = list(dict.fromkeys(BRACKETED.findall("\n".join(self.seen[player][-3:]))))
        valid = []
        for move in candidates:
            trial = copy.copy(self)
            trial.game, trial.errors, trial.seen = copy.deepcopy(self.game), list(self.errors), {}
            with trial._own_random():
                before = trial._error_count()
                done, _ = trial.game.step(move)
                if done and (trial.game.state.game_info.get(player) or {}).get("invalid_move"):
                    continue
                if trial._error_count() > before:
                    continue
            valid.append(move)
        return valid


class TextArenaGame(_TextArenaEnv):
    """A TextArena game of two or more players as a tinkerless multi-agent env (roles `player_0`, ...)."""

    agents: tuple[str, ...] = ()

    def reset(self, seed: int | None = None) -> None:
        self._new_game(seed)
        self.winner: str | None = None
        self.shown: dict[str, str] = {}

    def turn(self) -> str | None:
        return None if self.done else self.agents[self._current()]

    def response_prefix(self, agent: str) -> str:
        return self.prefix

    def observation(self, agent: str) -> str:
        player = self._player(agent)
        if agent not in self.shown:  # one call per turn takes the game's queue; a second gets the same text
            self.shown[agent] = self._pending(player)
        return self.shown[agent]

    def step(self, agent: str, action: str) -> MultiStepResult:
        player = self._player(agent)
        if self.done:
            raise EnvError(f"the TextArena {self.env_id} game is over", hint="stop stepping once turn() returns None")
        if player != self._current():
            raise EnvError(f"it is {self.agents[self._current()]}'s turn, not {agent}'s")
        self.observation(agent)  # a scripted opponent may move without reading: its messages are taken all the same
        self.shown.pop(agent, None)
        done, invalid = self._play(player, action)
        rewards = {role: 0.0 for role in self.agents}
        if invalid:
            rewards[agent] += self.invalid_penalty
        info: dict[str, Any] = {"invalid_moves": {self.agents[i]: n for i, n in enumerate(self.errors)}}
        if done:
            self.done = True
            final, game_info = self._final_rewards()
            for i, value in final.items():
                rewards[self.agents[i]] += _number(value, f"TextArena {self.env_id} reward of player {i}")
            self.winner = _winner({self.agents[i]: v for i, v in final.items()})
            info.update(winner=self.winner, outcome={self.agents[i]: final[i] for i in final},
                        reason=_reason(game_info))
        return MultiStepResult(rewards=rewards, done=done, info=info)

    def _player(self, agent: str) -> int:
        if agent not in self.agents:
            raise EnvError(f"unknown role {agent!r} of TextArena {self.env_id}", hint=f"roles are {list(self.agents)}")
        return self.agents.index(agent)


class TextArenaSinglePlayer(_TextArenaEnv):
    """A one-player TextArena game as a single-agent env: `reset(seed) -> str`, `step(text) -> StepResult`."""

    def reset(self, seed: int | None = None) -> str:
        self._new_game(seed)
        return self._pending(0)

    def step(self, action: str) -> StepResult:
        if self.done:
            raise EnvError(f"the TextArena {self.env_id} game is over")
        done, invalid = self._play(0, action)
        reward = self.invalid_penalty if invalid else 0.0
        if done:
            self.done = True
            final, game_info = self._final_rewards()
            reward += _number(final[0], f"TextArena {self.env_id} reward")
            return StepResult(observation=None, reward=reward, done=True,
                              info={"invalid_moves": self.errors[0], "reason": _reason(game_info)})
        return StepResult(observation=self._pending(0), reward=reward, done=False, info={"invalid_moves": self.errors[0]})


def random_opponent(env: _TextArenaEnv, agent: str, rng: random.Random) -> str:
    """A uniformly random valid move among the bracketed moves the game showed this player (e.g. tic-tac-toe's
    "Available Moves: '[0]', '[4]'"); games that list no moves get "[?]" (an invalid move, handled as any)."""
    player = env.agents.index(agent) if hasattr(env, "agents") and agent in env.agents else 0
    if hasattr(env, "observation"):
        env.observation(agent)
    moves = env.valid_moves(player)
    return rng.choice(moves) if moves else "[?]"


# --- helpers -------------------------------------------------------------------------------------------------


def _render(messages: Any, player: int, state: Any) -> str:
    """TextArena's (from, text, kind) messages as one block of text; the player's own moves left out."""
    if isinstance(messages, str):
        return messages
    roles = getattr(state, "role_mapping", {}) or {}
    lines = []
    for message in messages if isinstance(messages, (list, tuple)) else [messages]:
        if isinstance(message, (list, tuple)) and len(message) >= 2:
            sender, text = message[0], message[1]
            if sender == player:
                continue
            text = str(text)
            lines.append(text if sender == -1 else f"[{roles.get(sender, f'Player {sender}')}] {text}")
        else:
            lines.append(str(message))
    return "\n\n".join(lines) if lines else "(no new messages)"


def _winner(final: dict[str, Any]) -> str:
    values = {role: float(v) for role, v in final.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if not values:
        return "draw"
    best = max(values.values())
    top = [role for role, v in values.items() if v == best]
    return top[0] if len(top) == 1 and len(set(values.values())) > 1 else "draw"


def _reason(game_info: Any) -> str | None:
    if isinstance(game_info, dict):
        for value in game_info.values():
            if isinstance(value, dict) and value.get("reason"):
                return str(value["reason"])[:500]
    return None


def _number(value: Any, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EnvError(f"{source} is {value!r}, not a number")
    return float(value)


def _refuse_unrunnable(base_id: str, spec: Any) -> None:
    game = str(spec.entry_point).split(".")[2] if str(spec.entry_point).startswith("textarena.envs.") else base_id.split("-")[0]
    if game in NEEDS_NETWORK:
        raise ConfigError(f"TextArena {base_id} needs a hosted LLM (an OpenRouter API key and the network) for its "
                          "juror or game master; tinkerless runs envs offline", hint="pick a game without an LLM judge")
    if game in NEEDS_NLTK:
        nltk = require("nltk")
        for resource in NEEDS_NLTK[game]:
            try:
                nltk.data.find(resource)
            except LookupError:
                raise ConfigError(
                    f"TextArena {base_id} needs NLTK's {resource!r} data, which is not installed: no package registry "
                    "ships it, and scripts/install.sh could not reach NLTK's data server to fetch it",
                    hint="where the network reaches it, run scripts/install.sh again (or python -m nltk.downloader "
                    f"{' '.join(r.split('/')[-1] for r in NEEDS_NLTK[game])})",
                ) from None
    try:
        module, _ = str(spec.entry_point).split(":")
        __import__(module)
    except SyntaxError as exc:
        raise ConfigError(f"TextArena {base_id}'s code needs a newer Python than {sys.version.split()[0]} "
                          f"(it uses Python 3.12 syntax: {exc.msg})", hint="run it on Python 3.12 or later") from exc
    except ModuleNotFoundError as exc:
        raise ConfigError(f"TextArena {base_id} needs the {exc.name!r} package, which is not installed",
                          hint=f"pip install {exc.name}") from exc


def _player_count(ta: Any, base_id: str, game_kwargs: dict) -> int:
    """The first player count the game accepts (most games take exactly one)."""
    failures = []
    state = random.getstate()
    try:
        for count in PLAYER_COUNTS:
            try:
                game = ta.make(base_id + "-raw", **game_kwargs)
                game.reset(num_players=count, seed=0)
                return count
            except Exception as exc:  # the game's own check of num_players (an assert or a ValueError)
                failures.append(f"{count}: {type(exc).__name__}: {exc}"[:200])
    finally:
        random.setstate(state)
    raise ConfigError(f"TextArena {base_id} could not be started with {list(PLAYER_COUNTS)} players",
                      hint="pass num_players=...; the game said: " + " | ".join(failures[:3]))
