"""TextArena through tinkerless.envs.textarena: players as seats, invalid moves, final rewards, refusals, rollouts."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("textarena")

import textarena as ta  # noqa: E402

import tinkerless  # noqa: E402
from tinkerless.envs.adapters.textarena import random_opponent  # noqa: E402
from tinkerless.errors import ConfigError  # noqa: E402
from tinkerless.wire import pack_code  # noqa: E402
from tinkerless.wire.messages import (  # noqa: E402
    CreatePolicyRequest,
    EpisodeLimits,
    LoraConfig,
    MultiAgentRolloutRequest,
    RolloutRequest,
    SamplingParams,
    Seat,
)

GAMES = ["TicTacToe-v0", "ConnectFour-v0", "KuhnPoker-v0", "Nim-v0", "ThreePlayerTicTacToe-v0"]


def _moves(seed: int):
    """A fixed stream of moves: mostly valid ones, every fourth garbage (an invalid move)."""
    rng = random.Random(seed)

    def move(env, role, count):
        return "no move here" if count % 4 == 3 else random_opponent(env, role, rng)
    return move


@pytest.mark.parametrize("game_id", GAMES)
def test_a_game_through_the_adapter_is_the_library_game_move_for_move(game_id):
    Game = tinkerless.envs.textarena(game_id)
    assert Game.agents == tuple(f"player_{i}" for i in range(Game.num_players))
    env, move = Game(), _moves(1)
    env.reset(seed=11)
    library = ta.make(game_id + "-raw")
    library.reset(num_players=Game.num_players, seed=11)
    totals, played, invalid_seen = {a: 0.0 for a in Game.agents}, 0, 0
    while (role := env.turn()) is not None:
        assert role == Game.agents[library.state.current_player_id]
        text = move(env, role, played)
        before = library.state.current_player_id
        errors = library.state.error_count
        done, _ = library.step(text)  # the same move on the library's own game
        result = env.step(role, text)
        assert result.done == done
        library_invalid = library.state.error_count > errors or (done and library.state.game_info[before].get("invalid_move"))
        assert (result.rewards[role] <= -0.1 + 1e-9 or done) if library_invalid else result.rewards[role] >= 0 or done
        if library_invalid and not done:
            invalid_seen += 1
            assert library.state.current_player_id == before and env.turn() == role  # the player does not advance
        for agent, value in result.rewards.items():
            totals[agent] += value
        played += 1
    rewards, _ = library.close()
    penalties = {a: -0.1 * n for a, n in result.info["invalid_moves"].items()}
    for i, agent in enumerate(Game.agents):
        assert math.isclose(totals[agent], rewards[i] + penalties[agent], abs_tol=1e-9)
    assert result.info["winner"] in (*Game.agents, "draw") and invalid_seen + sum(result.info["invalid_moves"].values()) > 0


def test_games_keep_their_own_random_state_when_played_side_by_side():
    Game = tinkerless.envs.textarena("KuhnPoker-v0")  # deals cards from the global random
    def play(envs):
        rng, logs = random.Random(0), {id(e): [] for e in envs}
        while any(e.turn() for e in envs):
            for env in envs:
                if (role := env.turn()) is not None:
                    logs[id(env)].append(env.observation(role))
                    env.step(role, random_opponent(env, role, rng) if False else "[check]")
        return [logs[id(e)] for e in envs]
    alone = []
    for seed in (1, 2):
        env = Game(); env.reset(seed=seed)
        alone += play([env])
    together = [Game(), Game()]
    together[0].reset(seed=1); together[1].reset(seed=2)
    random.seed(12345)  # whatever the process's global generator does meanwhile
    assert play(together) == alone


def test_single_player_games_are_single_agent_envs():
    Guess = tinkerless.envs.textarena("GuessTheNumber-v0")
    assert not hasattr(Guess, "agents") and Guess.num_players == 1
    env = Guess()
    first = env.reset(seed=4)
    assert "Guess The Number" in first
    result = env.step("not a guess")
    assert result.reward == pytest.approx(-0.1) and not result.done and "invalid" in result.observation.lower()
    for number in range(1, 21):
        result = env.step(f"[{number}]")
        if result.done:
            break
    assert result.done and result.reward == 1.0


@pytest.mark.parametrize("game_id, reason", [
    ("Chess-v0", "newer Python"), ("Debate-v0", "hosted LLM"), ("Wordle-v0", "NLTK"), ("TicTacTo-v0", "no game"),
])
def test_games_that_cannot_run_here_are_refused_with_the_reason(game_id, reason):
    try:
        import nltk
        nltk.data.find("corpora/words")
        if reason == "NLTK":
            pytest.skip("NLTK's words corpus is installed on this machine")
    except LookupError:
        pass
    with pytest.raises(ConfigError, match=reason):
        tinkerless.envs.textarena(game_id)


def test_word_games_run_once_their_nltk_data_is_found_and_name_what_is_missing_otherwise(tmp_path, monkeypatch):
    """What install.sh fetches where NLTK's data server is reachable, laid out as NLTK lays it out (a few words
    here): Hangman, which reads the word list only, is admitted and plays; Wordle, which also needs the tagger, is
    refused naming the tagger."""
    import nltk

    words = tmp_path / "nltk_data" / "corpora" / "words"
    words.mkdir(parents=True)
    for name in ("en", "en-basic"):
        (words / name).write_text("apple\nbread\nchair\nhouse\nriver\n")
    (words / "README").write_text("a test word list\n")
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path / "nltk_data")])
    Hangman = tinkerless.envs.textarena("Hangman-v0")
    game = Hangman()
    assert isinstance(game.reset(seed=3), str)
    target = game.game.state.game_state["target_word"]
    assert target in {"apple", "bread", "chair", "house", "river"}  # drawn from the word list found
    for letter in dict.fromkeys(target):  # guessing its letters wins: the game ran on that data
        result = game.step(f"[{letter}]")
    assert result.done and result.reward == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="averaged_perceptron_tagger_eng") as caught:
        tinkerless.envs.textarena("Wordle-v0")
    assert "install.sh" in caught.value.hint


# --- through the rollout loop, on the tiny model ------------------------------------------------------------


@pytest.fixture(scope="module")
def ta_worker(worker):
    worker.create_policy(CreatePolicyRequest("ta-player", LoraConfig(rank=4, seed=3)))
    return worker


def _rollout(worker, Game, seats, *, max_tokens=3, max_episode_tokens=2048, group_size=2, seed=5):
    return worker.rollout_multi(MultiAgentRolloutRequest(
        tasks=[{"seed": 1}, {"seed": 2}], group_size=group_size, env=pack_code(Game), seats=seats,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
        limits=EpisodeLimits(max_turns=12, max_episode_tokens=max_episode_tokens), seed=seed, protocol_timeout=60.0,
    )).episodes


def test_self_play_gives_each_player_its_own_tokens_and_the_games_rewards(ta_worker):
    Game = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[", invalid_penalty=-0.5)
    episodes = _rollout(ta_worker, Game, {r: Seat("ta-player") for r in Game.agents})
    assert len(episodes) == 8 and all(e.status in ("ok", "truncated") for e in episodes)
    tokenizer = ta_worker.tokenizer
    played = [e for e in episodes if e.transcript]  # a player whose opponent forfeited first never moved
    assert len(played) >= 4
    for episode in played:
        tokens, mask = episode.tokens.tolist(), episode.mask.tolist()
        runs, current = [], []  # the sampled stretches of the episode, one per turn
        for token, bit in zip(tokens + [None], mask + [0]):
            if bit:
                current.append(token)
            elif current:
                runs, current = runs + [current], []
        moves = [m["content"] for m in episode.transcript if m["role"] == "assistant"]
        assert len(runs) == len(moves)
        for run, move in zip(runs, moves):  # the "[" prefix is the env's (mask 0), the rest sampled
            assert move == "[" + tokenizer.decode(run, skip_special_tokens=True)
        assert (episode.sampler_logprobs[episode.mask == 1] < 0).all() and (episode.sampler_logprobs[episode.mask == 0] == 0).all()
        assert "Tic Tac Toe" in episode.transcript[0]["content"]
    for game in {e.info["game"] for e in episodes}:
        pair = [e for e in episodes if e.info["game"] == game]
        outcomes = sorted(e.info["outcome"] for e in pair)
        assert outcomes in (["loss", "win"], ["draw", "draw"], ["unfinished", "unfinished"])


def test_against_the_random_opponent_only_the_learner_is_trained(ta_worker):
    Game = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")
    seats = {"player_0": Seat("ta-player"), "player_1": Seat(opponent=pack_code(random_opponent), trainable=False)}
    episodes = _rollout(ta_worker, Game, seats)
    assert {e.info["role"] for e in episodes} == {"player_0"} and len(episodes) == 4
    for episode in episodes:  # the opponent's moves reach the learner as text only
        later = [m["content"] for m in episode.transcript[1:] if m["role"] == "user"]
        assert all("[Player 1]" in text for text in later if "placed their symbol" in text)


class _Raising:
    def step(self, agent, action):  # the second move of every game raises
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2:
            raise RuntimeError("the game broke")
        return super().step(agent, action)


class _NaNReward:
    def _final_rewards(self):
        return {0: float("nan"), 1: 0.0}, {}


class _Huge:
    def observation(self, agent):  # from each player's second turn on: a first prompt is the sampler's to bound
        text = super().observation(agent)
        self.seen_by = getattr(self, "seen_by", set())
        huge = agent in self.seen_by
        self.seen_by.add(agent)
        return text + "x" * 200_000 if huge else text


@pytest.mark.parametrize("mixin, status", [(_Raising, "error"), (_NaNReward, "error"), (_Huge, "truncated")])
def test_hostile_games_end_their_episodes_not_the_worker(ta_worker, mixin, status):
    Base = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")
    Hostile = type("Hostile", (mixin, Base), {})
    seats = {r: Seat("ta-player") for r in Base.agents}
    episodes = _rollout(ta_worker, Hostile, seats, max_episode_tokens=4096 if mixin is _Huge else 2048)
    assert episodes and {e.status for e in episodes} <= {status, "ok"} and any(e.status == status for e in episodes)
    assert ta_worker.rollout(RolloutRequest(policy="ta-player", tasks=[{"prompt": "still alive?"}], group_size=1,
                                            sampling=SamplingParams(max_tokens=2), limits=EpisodeLimits(max_turns=1, max_episode_tokens=256),
                                            seed=0)).episodes[0].status == "ok"


def test_train_with_a_frozen_seat_a_round_robin_and_max_staleness(tmp_path, tiny_model):
    import json

    Game = tinkerless.envs.textarena("TicTacToe-v0", response_prefix="[")
    seatings = [{"player_0": "a", "player_1": tinkerless.Frozen()}, *tinkerless.round_robin(["a", "b"], roles=Game.agents)]
    result = tinkerless.train(model=tiny_model, env=Game, tasks=Game.tasks, agents=seatings, steps=2, batch_size=1,
                              group_size=2, max_turns=8, max_tokens=3, max_episode_tokens=2048, max_staleness=1,
                              storage=str(tmp_path), progress=False, checkpoint_every=2)
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1] and all(line["episodes_error"] == 0 for line in lines)
    assert all(f"win_rate/{p}" in lines[0] for p in ("a", "b"))


@pytest.mark.parametrize("game_id", ["TicTacToe-v0", "ConnectFour-v0"])
def test_a_games_update_runs_each_episode_token_once_however_many_turns(ta_worker, game_id):
    """A player's episode is its conversation, each message once (TextArena's observations are incremental: no
    transcript re-sent per turn), and the update runs every episode's tokens through the model once (twice with
    recomputed layers), not once per turn: processed tokens stay proportional to the episodes' real lengths."""
    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.messages import AdamParams, Datum, UpdateRequest

    Game = tinkerless.envs.textarena(game_id, response_prefix="[")
    seats = {"player_0": Seat("ta-player"), "player_1": Seat(opponent=pack_code(random_opponent), trainable=False)}
    episodes = [e for e in _rollout(ta_worker, Game, seats, max_tokens=6, group_size=3) if e.transcript]
    tokenizer = ta_worker.tokenizer
    for episode in episodes:
        text = tokenizer.decode(episode.tokens.tolist())
        users = [m["content"] for m in episode.transcript if m["role"] == "user"]
        assert len(users) >= 2
        for message in users:  # every observation once: a re-sent history would repeat the first ones
            assert text.count(message) == 1, (message, text)
        shown = sum(len(tokenizer.encode(m["content"], add_special_tokens=False)) for m in episode.transcript)
        assert len(episode.tokens) <= shown + 16 * len(episode.transcript)  # the template's few tokens per message

    ta_worker.create_policy(CreatePolicyRequest("ta-cost", LoraConfig(rank=4, seed=4)))
    data = [Datum(tokens=e.tokens, mask=e.mask, advantages=e.mask * (1.0 if i % 2 else -1.0), sampler_logprobs=e.sampler_logprobs)
            for i, e in enumerate(episodes)]
    processed = []
    hook = ta_worker.model.get_input_embeddings().register_forward_hook(lambda m, args, out: processed.append(args[0].numel()))
    try:
        ta_worker.update(UpdateRequest("ta-cost", data, LossConfig(), AdamParams(learning_rate=1e-3)))
    finally:
        hook.remove()
    real = sum(len(e.tokens) for e in episodes)
    # A group's shared first prompt runs once (shared_prefix), so fewer tokens than `real` may run; never more
    # than each token twice (a forward, and a recomputing one in backward) and a little padding.
    assert 0 < sum(processed) <= 2 * real + 64 * len(episodes), (sum(processed), real)
