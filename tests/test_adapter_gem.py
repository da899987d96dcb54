"""GEM's 5-tuple text envs (and any 4- or 5-tuple gym-style env) through tinkerless.envs.gem / text_gym."""

from __future__ import annotations

import random

import pytest

import tinkerless
from tinkerless.errors import ConfigError, EnvError


class FourTuple:
    """An old-style gym text env: step gives (obs, reward, done, info)."""

    def reset(self, seed=None):
        self.target, self.turns = random.randrange(5), 0  # from the global random, as such envs do
        return "guess 0-4", {}

    def step(self, action):
        self.turns += 1
        hit = action.strip() == str(self.target)
        return ("yes" if hit else "no"), float(hit), hit or self.turns >= 3, {"turns": self.turns, "obj": object()}


def test_a_four_tuple_env_and_its_own_random_state():
    Env = tinkerless.envs.text_gym(FourTuple)
    env = Env()
    assert env.reset(seed=3) == "guess 0-4"
    targets = []
    for seed in (3, 4, 3):
        env = Env()
        env.reset(seed=seed)
        random.seed(999)  # the process's generator does not leak into the episode's
        targets.append(env.env.target)
    assert targets[0] == targets[2]
    results = [env.step(str(n)) for n in range(3)]
    assert results[-1].done and all(r.info == {"turns": i + 1} for i, r in enumerate(results))  # non-plain info dropped


def test_a_wrong_step_shape_is_an_env_error():
    class Broken(FourTuple):
        def step(self, action):
            return "obs", 1.0
    env = tinkerless.envs.text_gym(Broken)()
    env.reset(seed=0)
    with pytest.raises(EnvError, match="not \\(obs, reward, terminated, truncated, info\\)"):
        env.step("x")


gem_library = pytest.importorskip("gem")


@pytest.mark.parametrize("env_id", ["game:GuessTheNumber-v0-easy", "game:Mastermind-v0-easy", "rg:leg_counting"])
def test_gem_envs_map_the_five_tuple(env_id):
    Env = tinkerless.envs.gem(env_id)
    env, library = Env(), gem_library.make(env_id)
    first = env.reset(seed=5)
    observation, info = library.reset(seed=5)
    assert first.startswith(observation)
    for move in ("\\boxed{3}", "\\boxed{1 2 3 4}", "\\boxed{7}"):
        mine = env.step(move)
        obs, reward, terminated, truncated, info = library.step(move)
        assert (mine.reward, mine.done) == (reward, terminated or truncated)
        if mine.done:
            break
        assert mine.observation.startswith(obs)


def test_gem_ids_that_need_a_download_or_do_not_exist_are_refused():
    with pytest.raises(ConfigError, match="no env"):
        tinkerless.envs.gem("game:NoSuchGame-v0")
    downloads = [i for i in gem_library.envs.registration.ENV_REGISTRY if i.startswith("math:")]
    if downloads:
        with pytest.raises(ConfigError, match="cannot run offline"):
            tinkerless.envs.gem(downloads[0])
