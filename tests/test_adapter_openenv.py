"""OpenEnv through tinkerless.envs.openenv: in-process and over a loopback server, actions from text, dropped servers."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("openenv.core.env_server")

from openenv.core.env_server import Action, Environment, Observation, State  # noqa: E402

import tinkerless  # noqa: E402
from tinkerless.envs.adapters.openenv import action_fields, serve  # noqa: E402
from tinkerless.errors import ConfigError, EnvError, InfrastructureFailure  # noqa: E402
from tinkerless.wire import pack_code  # noqa: E402
from tinkerless.wire.messages import EpisodeLimits, RolloutRequest, SamplingParams  # noqa: E402


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str


class GuessEnv(Environment):
    """Guess a number in [0, 9]: -0.1 a wrong guess (with a hint), 1 the right one."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.secret, self.tries = random.Random(seed).randrange(10), 0
        return GuessObservation(message="Guess a number from 0 to 9.", done=False, reward=0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self.tries += 1
        if action.guess == self.secret:
            return GuessObservation(message="right", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        return GuessObservation(message=f"{hint} than {action.guess}", done=self.tries >= 6, reward=-0.1)

    @property
    def state(self) -> State:
        return State(step_count=getattr(self, "tries", 0))


class NoteAction(Action):
    text: str
    loud: bool = False


class NoteObservation(Observation):
    echoed: str
    length: int


class EchoEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs) -> NoteObservation:
        if kwargs.get("explode"):
            raise ValueError("reset exploded")
        return NoteObservation(echoed="", length=0)

    def step(self, action: NoteAction, timeout_s=None, **kwargs) -> NoteObservation:
        if action.text == "crash":
            raise RuntimeError("the env broke")
        text = action.text.upper() if action.loud else action.text
        return NoteObservation(echoed=text, length=len(text), done=action.text.endswith("."), reward=float(len(text)))

    @property
    def state(self) -> State:
        return State()


def _play(Env, task, moves):
    env = Env()
    seen = [env.reset(**task)]
    results = []
    for move in moves:
        results.append(env.step(move))
        seen.append(results[-1].observation)
        if results[-1].done:
            break
    return seen, [(r.reward, r.done, r.info.get("action_error", False)) for r in results]


MOVES = ["I think 5", "{\"guess\": 2}", "no idea", "{\"guess\": \"many\"}", "7", "3", "1", "0", "4", "6", "8", "9"]


@pytest.fixture(scope="module")
def guess_server():
    with serve(GuessEnv, max_concurrent_envs=4) as url:
        yield url


def test_in_process_and_loopback_play_the_same_episodes(guess_server):
    local, remote = tinkerless.envs.openenv(GuessEnv), tinkerless.envs.openenv(guess_server)
    assert '"guess": integer' in local().system_prompt() and '"guess": integer' in remote().system_prompt()
    long_games = 0
    for seed in range(6):
        expected = _play(local, {"seed": seed}, MOVES)
        assert _play(remote, {"seed": seed}, MOVES) == expected
        observations, results = expected
        assert results[-1][1] and results[0][2] is False
        if len(results) > 4:
            long_games += 1
            assert results[2] == (0.0, False, True) and results[3] == (0.0, False, True)  # shown to the model, not stepped
            assert "No number found" in observations[3] and "rejected" in observations[4]  # "many" is not an integer
    assert long_games


def test_actions_are_built_against_the_schema():
    schema = NoteAction.model_json_schema()
    assert action_fields("hello there", schema) == ({"text": "hello there"}, None)
    assert action_fields('sure: {"text": "a", "loud": true} ok', schema) == ({"text": "a", "loud": True}, None)
    Echo = tinkerless.envs.openenv(EchoEnv)
    env = Echo()
    assert env.reset() == '{"echoed": "", "length": 0}'
    result = env.step('{"text": "hi", "loud": true}')
    assert (result.observation, result.reward, result.done) == ('{"echoed": "HI", "length": 2}', 2.0, False)
    assert "rejected" in env.step('{"txt": "x"}').observation
    assert env.step("bye.").done


def test_a_raising_env_is_an_env_error_in_process_and_remotely():
    with pytest.raises(RuntimeError, match="the env broke"):
        env = tinkerless.envs.openenv(EchoEnv)()
        env.reset()
        env.step("crash")
    with serve(EchoEnv, max_concurrent_envs=2) as url:
        env = tinkerless.envs.openenv(url)()
        env.reset()
        with pytest.raises(EnvError, match="the env broke"):
            env.step("crash")
        env = tinkerless.envs.openenv(url)()  # the next episode connects anew
        env.reset()
        assert env.step("fine.").done


def test_a_dropped_server_is_an_infrastructure_failure_and_never_a_desync():
    with serve(GuessEnv) as url:
        Remote = tinkerless.envs.openenv(url)
        env = Remote()
        env.reset(seed=1)
        env.step("3")
    with pytest.raises(InfrastructureFailure) as failure:
        env.step("4")  # the server is gone: this episode fails, it never reads a stale answer
    assert failure.value.cause == "env_server_unreachable"
    with pytest.raises(InfrastructureFailure) as failure:
        Remote().reset(seed=1)
    assert failure.value.cause == "env_server_unreachable"
    with pytest.raises(InfrastructureFailure):
        tinkerless.envs.openenv(url)  # no schema to read


def test_episodes_side_by_side_up_to_the_servers_limit(guess_server):
    Remote = tinkerless.envs.openenv(guess_server)
    envs = [Remote() for _ in range(4)]
    for seed, env in enumerate(envs):
        env.reset(seed=seed)
    with pytest.raises(InfrastructureFailure) as failure:
        Remote().reset(seed=9)  # a fifth session at once
    assert failure.value.cause == "env_server_capacity"
    for seed, env in enumerate(envs):  # each session kept its own game
        assert env.step(str(random.Random(seed).randrange(10))).done


def test_bad_sources_are_refused():
    for source in ("not a url", 42, dict):
        with pytest.raises(ConfigError):
            tinkerless.envs.openenv(source)


def test_rollouts_through_the_server_equal_in_process_ones(worker, guess_server):
    def episodes(Env):
        request = RolloutRequest(policy="base", tasks=[{"seed": 1}, {"seed": 2}], group_size=2, env=pack_code(Env),
                                 sampling=SamplingParams(max_tokens=4, temperature=1.0),
                                 limits=EpisodeLimits(max_turns=4, max_episode_tokens=1024), seed=3)
        return worker.rollout(request).episodes
    local, remote = episodes(tinkerless.envs.openenv(GuessEnv)), episodes(tinkerless.envs.openenv(guess_server))
    assert len(local) == 4 and {e.status for e in local} <= {"ok", "truncated"}
    for a, b in zip(local, remote):
        assert (a.tokens == b.tokens).all() and (a.mask == b.mask).all() and a.reward == b.reward and a.transcript == b.transcript


def test_a_run_through_the_server_trains_as_in_process(tmp_path, tiny_model, guess_server):
    def run(env, where):
        result = tinkerless.train(model=tiny_model, env=env, tasks=lambda rng: {"seed": rng.randrange(100)}, steps=2,
                                  batch_size=2, group_size=2, max_turns=3, max_tokens=4, temperature=1.0,
                                  learning_rate=1e-2, storage=str(tmp_path / where), progress=False, checkpoint_every=2)
        lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
        import json
        return [(r["reward_mean"], r["sampled_tokens"], r["episodes_error"]) for r in map(json.loads, lines)]
    assert run(tinkerless.envs.openenv(guess_server), "remote") == run(tinkerless.envs.openenv(GuessEnv), "local")


def _calc_env():
    from fastmcp import FastMCP
    from openenv.core.env_server import MCPEnvironment

    class CalcEnv(MCPEnvironment):
        """An MCP tool env: add and a tool that always fails; the episode ends at a fourth call."""

        def __init__(self):
            mcp = FastMCP("calc")

            @mcp.tool
            def add(a: int, b: int) -> int:
                """Add two integers."""
                return a + b

            @mcp.tool
            def fail(x: str) -> str:
                """Always fails."""
                raise ValueError("nope " + x)

            super().__init__(mcp)

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            return Observation(done=False, reward=0.0)

        def _step_impl(self, action, timeout_s=None, **kwargs) -> Observation:
            return Observation(done=False, reward=0.0)

        @property
        def state(self) -> State:
            return State()

    return CalcEnv


def test_mcp_tool_envs_offer_their_tools_in_the_tool_format(worker):
    pytest.importorskip("fastmcp")
    Calc = tinkerless.envs.openenv(_calc_env())
    env = Calc()
    prompt = env.system_prompt()
    assert "- add: Add two integers." in prompt and "<tool_call>" in prompt and '"b": {"type": "integer"}' in prompt
    env.reset(seed=1)
    steps = [env.step(text) for text in (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_call>{"name": "fail", "arguments": {"x": "y"}}</tool_call>',
        '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
        '<tool_call>{bad</tool_call>', "no action at all", "<answer>5</answer>")]
    assert steps[0].observation == "<tool_response>5</tool_response>"
    assert "error" in steps[1].observation and "nope y" in steps[1].observation
    assert "no tool 'sub'" in steps[2].observation and "invalid JSON" in steps[3].observation
    assert "No tool call" in steps[4].observation and steps[5].done and not any(s.done for s in steps[:5])
    episodes = worker.rollout(RolloutRequest(policy="base", tasks=[{"seed": 1}], group_size=2, env=pack_code(Calc),
                                             sampling=SamplingParams(max_tokens=8, temperature=1.0),
                                             limits=EpisodeLimits(max_turns=3, max_episode_tokens=2048), seed=1)).episodes
    assert {e.status for e in episodes} <= {"ok", "truncated"} and episodes[0].transcript[0]["content"] == prompt


class HostileEnv(EchoEnv):
    """Rewards, observations and types an env should never return (any text is an action here)."""

    mode = "nan"

    def step(self, action: NoteAction, timeout_s=None, **kwargs) -> NoteObservation:
        if self.mode == "nan":
            return NoteObservation(echoed="nan", length=3, done=False, reward=float("nan"))
        if self.mode == "huge":
            return NoteObservation(echoed="x" * 300_000, length=300_000, done=False, reward=0.0)
        return {"message": b"\xff bytes", "done": False, "reward": "lots"}  # not an Observation at all


@pytest.mark.parametrize("mode, status", [("nan", "error"), ("huge", "truncated"), ("wrong_type", "error")])
def test_hostile_env_values_end_their_episodes_not_the_worker(worker, mode, status):
    Env = tinkerless.envs.openenv(type("Hostile", (HostileEnv,), {"mode": mode}))
    request = RolloutRequest(policy="base", tasks=[{"seed": 1}], group_size=2, env=pack_code(Env),
                             sampling=SamplingParams(max_tokens=4, temperature=1.0),
                             limits=EpisodeLimits(max_turns=3, max_episode_tokens=2048), seed=1)
    episodes = worker.rollout(request).episodes
    assert {e.status for e in episodes} == {status}
