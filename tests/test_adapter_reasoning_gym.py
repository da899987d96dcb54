"""Reasoning Gym through tinkerless.envs.reasoning_gym: tasks, the library's scorer as reward, mixtures, curricula."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("reasoning_gym")

import reasoning_gym as rg  # noqa: E402

import tinkerless  # noqa: E402
from tinkerless.envs.adapters.reasoning_gym import CurriculumPolicy, _dataset  # noqa: E402
from tinkerless.errors import ConfigError, RewardError  # noqa: E402
from tinkerless.sdk.run.tasks import TaskSource  # noqa: E402

TASKS = ["chain_sum", "leg_counting", "basic_arithmetic", "word_sorting", "letter_counting", "spell_backward"]


def _wire(task: dict) -> dict:
    return json.loads(json.dumps(task))  # what reaches the worker: plain JSON


@pytest.mark.parametrize("name", TASKS)
def test_tasks_are_the_librarys_items_and_the_reference_answer_scores_one(name):
    gym = tinkerless.envs.reasoning_gym(name, seed=3)
    assert set(gym) == {"tasks", "reward", "system_prompt"} and "<answer>" in gym.system_prompt
    for index in range(3):
        task = _wire(gym.tasks(random.Random(index)))
        meta = task["reasoning_gym"]
        library = rg.create_dataset(name, **meta["config"])[meta["index"]]  # the library's own item, made apart
        assert task["prompt"] == library["question"] and task["answer"] == library["answer"]
        _dataset.cache_clear()  # the worker rebuilds the item from the task alone
        assert gym.reward(f"thinking... <answer>{task['answer']}</answer>", task) == 1.0
        assert gym.reward("no tag at all", task) == library_score(name, None, library)
        assert gym.reward("<answer>surely wrong §</answer>", task) == library_score(name, "surely wrong §", library)


def library_score(name, answer, entry):
    return rg.create_dataset(name).score_answer(answer, entry)


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others():
    a = [tinkerless.envs.reasoning_gym("chain_sum", seed=1).tasks(random.Random(i)) for i in range(5)]
    b = [tinkerless.envs.reasoning_gym("chain_sum", seed=1).tasks(random.Random(i)) for i in range(5)]
    c = [tinkerless.envs.reasoning_gym("chain_sum", seed=2).tasks(random.Random(i)) for i in range(5)]
    assert a == b and a != c


def test_a_mixture_draws_by_weight_and_scores_each_item_with_its_own_dataset():
    gym = tinkerless.envs.reasoning_gym([("chain_sum", 3.0), ("leg_counting", 1.0, {"max_animals": 3}),
                                         rg.composite.DatasetSpec("spell_backward", 1.0, {})])
    tasks = [_wire(gym.tasks(random.Random(i))) for i in range(400)]
    counts = {name: sum(t["reasoning_gym"]["dataset"] == name for t in tasks) for name in ("chain_sum", "leg_counting", "spell_backward")}
    assert counts["chain_sum"] > 2 * counts["leg_counting"] > 0 and counts["spell_backward"] > 0
    assert all(t["reasoning_gym"]["config"]["max_animals"] == 3 for t in tasks if t["reasoning_gym"]["dataset"] == "leg_counting")
    for task in tasks[:20]:
        assert gym.reward(f"<answer>{task['answer']}</answer>", task) == 1.0


def test_the_answer_format_can_be_overridden():
    gym = tinkerless.envs.reasoning_gym("chain_sum", system_prompt="Answer after ANSWER:",
                                        extract=lambda text: text.rsplit("ANSWER:", 1)[-1].strip())
    task = _wire(gym.tasks(random.Random(0)))
    assert gym.system_prompt == "Answer after ANSWER:"
    assert gym.reward(f"so ANSWER: {task['answer']}", task) == 1.0
    assert gym.reward(f"<answer>{task['answer']}</answer>", task) < 1.0  # the tag alone is no longer read
    assert tinkerless.envs.reasoning_gym("chain_sum", system_prompt="direct").system_prompt.startswith("Answer the question directly")


def test_a_scorer_that_raises_is_a_reward_error_naming_the_dataset():
    gym = tinkerless.envs.reasoning_gym("prime_factorization")
    task = _wire(gym.tasks(random.Random(0)))
    with pytest.raises(RewardError, match=r"prime_factorization.score_answer raised .*ValueError"):
        gym.reward("<answer>x</answer>", task)  # the library's scorer does int('x')


def test_bad_names_configs_and_tasks_fail_early_and_clearly():
    with pytest.raises(ConfigError, match="no dataset 'chain_summ'"):
        tinkerless.envs.reasoning_gym("chain_summ")
    with pytest.raises(ConfigError, match="could not make 'chain_sum'"):
        tinkerless.envs.reasoning_gym("chain_sum", min_terms=5, max_terms=2)
    with pytest.raises(ConfigError, match="named twice"):
        tinkerless.envs.reasoning_gym([("chain_sum", 1.0), ("chain_sum", 2.0)])
    for weight in (0, -1, float("nan"), True):
        with pytest.raises(ConfigError):
            tinkerless.envs.reasoning_gym([("chain_sum", weight)])
    gym = tinkerless.envs.reasoning_gym("chain_sum")
    with pytest.raises(RewardError, match="not a Reasoning Gym task"):
        gym.reward("<answer>1</answer>", {"prompt": "hi"})
    task = _wire(gym.tasks(random.Random(0)))
    with pytest.raises(RewardError, match="not the task's question"):
        gym.reward("<answer>1</answer>", {**task, "prompt": "another question"})


def test_the_curriculum_raises_the_level_when_the_reward_passes_and_replays_on_resume():
    gym = tinkerless.envs.reasoning_gym("chain_sum", curriculum=CurriculumPolicy(threshold=0.5, min_steps=2))
    source = TaskSource(gym.tasks, seed=0)
    levels = [source.observe_step({"step": s, "reward_mean": r})["curriculum/level"]
              for s, r in enumerate([0.1, 0.6, 0.9, 0.9, float("nan"), 0.7])]
    assert levels == [0.0, 1.0, 1.0, 2.0, 2.0, 3.0]  # min_steps=2 holds the raise after step 1 until step 3
    terms = [gym.tasks(random.Random(i))["reasoning_gym"]["config"]["max_terms"] for i in range(3)]
    assert terms == [5, 5, 5]  # the library's level 3 of chain_sum: at most 5 terms
    records = [{"step": s, "reward_mean": r} for s, r in enumerate([0.1, 0.6, 0.9, 0.9])]
    resumed = TaskSource(tinkerless.envs.reasoning_gym("chain_sum", curriculum=CurriculumPolicy(0.5, 2)).tasks, seed=0)
    resumed.replay(records)
    assert resumed.follower.level == 2
    source.replay(records[:2])  # replay starts over, whatever state it had
    assert source.follower.level == 1


def test_a_curriculum_level_the_librarys_own_config_rejects_is_not_taken():
    gym = tinkerless.envs.reasoning_gym("caesar_cipher", curriculum=0.0)  # its level 2 fails CaesarCipherConfig
    for step in range(4):
        gym.tasks.observe_step({"step": step, "reward_mean": 1.0})
    assert gym.tasks.level == 1
    gym.tasks(random.Random(0))


def test_eval_tasks_and_sft_data():
    gym = tinkerless.envs.reasoning_gym("basic_arithmetic")
    held_out = gym.eval_tasks(4)
    assert len(held_out) == 4 and held_out == gym.eval_tasks(4) and held_out != gym.eval_tasks(4, seed=9)
    rows = gym.sft_data(3)
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant"]
    for row, task in zip(rows, gym.eval_tasks(3, seed=2)):
        assert gym.reward(row["messages"][2]["content"], task) == 1.0


def test_train_runs_the_tasks_and_logs_the_curriculum_level(tmp_path, tiny_model):
    gym = tinkerless.envs.reasoning_gym("basic_arithmetic", curriculum=-1.0, min_terms=2, max_terms=2)
    result = tinkerless.train(model=tiny_model, **gym, steps=2, batch_size=2, group_size=2, max_tokens=6,
                              storage=str(tmp_path), progress=False, checkpoint_every=2, eval_every=None)
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["curriculum/level"] for line in lines] == [1.0, 2.0]  # threshold -1: every step passes
    assert all(line["episodes_error"] == 0 for line in lines)


def odd_lengths_break_the_scorer(completion):
    return "x" if len(completion) % 2 else "2"  # prime_factorization's scorer raises on int("x")


def test_a_raising_scorer_drops_episodes_and_the_run_goes_on(tmp_path, tiny_model):
    gym = tinkerless.envs.reasoning_gym("prime_factorization", extract=odd_lengths_break_the_scorer)
    result = tinkerless.train(model=tiny_model, **gym, steps=2, batch_size=4, group_size=2, max_tokens=5,
                              temperature=1.0, storage=str(tmp_path), progress=False, checkpoint_every=2)
    lines = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and sum(line["episodes_error"] for line in lines) > 0
    errors = [e for line in lines for e in line.get("errors", [])]
    assert any("prime_factorization.score_answer raised" in e["error"] for e in errors)
