"""`tinkerless eval`: the training agent loop with no training; pass@k over n samples; bad checkpoints.

The central check: evaluating checkpoint step-k with the tasks, group size and seed of training step k
plays exactly the episodes that training step k played, token for token (eval reuses the rollout)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tinkerless
from tinkerless.errors import ConfigError, StorageNotFound, UserError
from tinkerless.functions.models import build_tiny_model
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.evaluation.evaluate import evaluate
from tinkerless.sdk.run.trainer import _step_seed
from tinkerless.wire import decode_message
from tinkerless.wire.messages import RolloutResult


@tinkerless.env
class Echo:
    """Two turns: say the word back; a turn that does earns 1, any other a pseudo-random 0, 0.25 or 0.5
    (so the random tiny model's groups differ in reward and training moves its adapter)."""

    def reset(self, word: str) -> str:
        self.word, self.turn = word, 0
        return f"say {word}"

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        done = self.turn >= 2
        reward = 1.0 if self.word in action else 0.25 * (sum(map(ord, action)) % 3)
        return tinkerless.StepResult(None if done else "again", reward, done)


TASKS = [{"word": "a"}, {"word": "b"}, {"word": "c"}]


def _config(tiny_model, storage, **extra) -> tinkerless.TrainConfig:
    settings = dict(
        model=tiny_model, env=Echo, tasks=TASKS, batch_size=2, group_size=3, max_tokens=3, max_turns=2,
        temperature=1.0, storage=str(storage), progress=False, learning_rate=5e-2, seed=3,
    )
    return tinkerless.TrainConfig(**{**settings, **extra})


class RecordingBackend(LocalBackend):
    """A local backend that keeps every rollout's request and result as they crossed the wire."""

    def __init__(self, model: str):
        super().__init__(model)
        self.rollouts: list[tuple] = []

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        reply = super().call_bytes(method, payload)
        if method == "rollout":
            self.rollouts.append((decode_message(payload), decode_message(reply)))
        return reply


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """A 2-step run `ev` with a checkpoint after every step, and the rollouts its steps played."""
    storage = tmp_path_factory.mktemp("eval-store")
    backend = RecordingBackend(tiny_model)
    config = _config(tiny_model, storage, steps=2, checkpoint_every=1, keep_checkpoints=None, run_id="ev")
    tinkerless.train(config, backend=backend)
    assert len(backend.rollouts) == 2
    return config, storage, backend.rollouts


def test_eval_plays_the_training_steps_episodes_token_for_token(run):
    config, _, rollouts = run
    request, result = rollouts[1]  # step 1 sampled from the adapter after one update: checkpoint step-1
    assert isinstance(result, RolloutResult)
    report = evaluate(config, checkpoint="ev@1", tasks=request.tasks, samples=config.group_size,
                      seed=_step_seed(config.seed, 1))
    assert report.step == 1 and len(report.played) == len(result.episodes) == 2 * 3
    for ours, theirs in zip(report.played, result.episodes):
        assert ours.task_index == theirs.task_index and ours.status == theirs.status
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        np.testing.assert_array_equal(ours.mask, theirs.mask)
        np.testing.assert_allclose(ours.sampler_logprobs, theirs.sampler_logprobs, rtol=0, atol=1e-5)
        assert ours.transcript == theirs.transcript and ours.reward == theirs.reward
    # And it is the adapter that makes them so: the base model plays other episodes from the same seed.
    base = evaluate(config, checkpoint="base", tasks=request.tasks, samples=config.group_size, seed=_step_seed(config.seed, 1))
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in zip(base.played, result.episodes))


def test_report_counts_pass_at_k_from_n_samples(run):
    config, _, _ = run
    rewards = sorted(e.reward for e in evaluate(config, checkpoint="ev@latest", samples=3).played)
    assert rewards[0] < rewards[-1], rewards  # the tasks' episodes differ, so a threshold can split them
    # A threshold that some episodes reach and others do not (the same seed plays the same episodes again), so
    # the counts below mean something whatever the draws.
    threshold = next(r for r in reversed(rewards) if r > rewards[0])
    report = evaluate(config, checkpoint="ev@latest", samples=3, pass_threshold=threshold)
    assert report.step == 2 and report.num_tasks == len(TASKS) and report.episodes == 9
    passed = [0] * len(TASKS)
    for episode in report.played:
        passed[episode.task_index] += episode.reward >= threshold
    assert 0 < sum(passed) < 9
    expected_at_1 = sum(c / 3 for c in passed) / len(TASKS)
    expected_at_3 = sum(c > 0 for c in passed) / len(TASKS)
    assert report.pass_at == pytest.approx({1: expected_at_1, 3: expected_at_3})
    assert report.mean == pytest.approx(np.mean([e.reward for e in report.played]))
    assert report.sampled_tokens == sum(int(e.mask.sum()) for e in report.played)
    assert report.episodes_per_second > 0
    # A threshold no episode reaches: nothing passes.
    strict = evaluate(config, checkpoint="ev@latest", samples=3, pass_threshold=2.5)
    assert strict.pass_at == {1: 0.0, 3: 0.0} and strict.pass_rule == "reward >= 2.5"


def test_cli_eval_checkpoint_json_and_transcripts(run, tmp_path, capsys):
    config, storage, _ = run
    file = tmp_path / "echo_eval.py"
    file.write_text(
        "import tinkerless\nfrom test_eval import Echo, TASKS\n"
        f"config = tinkerless.TrainConfig(model={config.model!r}, env=Echo, tasks=TASKS, group_size=3, max_tokens=3,\n"
        f"    max_turns=2, temperature=1.0, storage={str(storage)!r}, seed=3)\n"
    )
    out = tmp_path / "episodes.jsonl"
    assert main(["eval", str(file), "--checkpoint", "ev@2", "--samples", "2", "--transcripts", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 2 and report["episodes"] == 6 and report["samples_per_task"] == 2
    assert set(report["pass_at"]) == {"1"}  # pass@group_size (3) needs 3 samples per task
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 and all(r["step"] == 2 for r in records)
    for record in records:
        assert record["passed"] == (record["reward"] > 0)
        assert record["tokens"]["sampled"] == sum(record["tokens"]["sampled_per_turn"]) > 0
    assert main(["eval", str(file), "--checkpoint", "base", "--tasks", "2", "--samples", "3"]) == 0
    text = capsys.readouterr().out
    assert "over 6 episodes (0 failed)" in text and "pass@1 " in text and "pass@3 " in text and "episodes/s" in text


def test_eval_uses_the_held_out_tasks_when_the_config_has_them(run):
    config, _, _ = run
    held_out = [{"word": "zz"}]
    report = evaluate(config.replace(eval_tasks=held_out), checkpoint="base", samples=2)
    assert report.num_tasks == 1 and all("say zz" in e.transcript[0]["content"] for e in report.played)


# ---- bad input: each names the culprit and the fix, before any model work where it can --------


@pytest.mark.parametrize(
    "spec, fragment",
    [("ev", "names no step"), ("ev@two", "is not a whole number"), ("ev@-1", "is not a whole number"),
     ("../x@1", "is not a run id"), ("", "is empty")],
)
def test_malformed_checkpoint_names(run, spec, fragment):
    config, _, _ = run
    with pytest.raises(UserError, match=fragment) as caught:
        evaluate(config, checkpoint=spec)
    assert "RUN_ID@latest" in caught.value.hint


def test_unknown_run_and_step(run):
    config, _, _ = run
    with pytest.raises(UserError, match="run 'evv' does not exist") as caught:
        evaluate(config, checkpoint="evv@1")
    assert "did you mean 'ev'" in caught.value.hint and "tinkerless runs" in caught.value.hint
    with pytest.raises(StorageNotFound, match=r"no checkpoint for step 7 .*available steps: \[1, 2\]"):
        evaluate(config, checkpoint="ev@7")


def test_checkpoint_of_another_base_model_is_refused(run, tmp_path):
    config, _, _ = run
    # Same architecture and shapes, other weights: the adapter would load and silently mean nothing.
    other = build_tiny_model(tmp_path / "other-tiny", seed=1)
    with pytest.raises(UserError, match="was trained on base model") as caught:
        evaluate(config.replace(model=other), checkpoint="ev@1")
    assert f"--model {config.model}" in caught.value.hint


def test_conflicting_and_invalid_options(run, capsys):
    config, _, _ = run
    with pytest.raises(ConfigError, match="not several"):
        evaluate(config, checkpoint="ev@1", run_id="ev")
    with pytest.raises(ConfigError, match="samples per task"):
        evaluate(config, samples=0)
    with pytest.raises(ConfigError, match="number of eval tasks"):
        evaluate(config, num_tasks=-2)
    with pytest.raises(ConfigError, match="pass threshold"):
        evaluate(config, pass_threshold=float("nan"))
    with pytest.raises(ConfigError, match="seed must be a whole number"):
        evaluate(config, seed=-1)
    with pytest.raises(SystemExit):  # argparse: --checkpoint and --run-id are exclusive
        main(["eval", "x.py", "--checkpoint", "ev@1", "--run-id", "ev"])
    capsys.readouterr()


def test_eval_through_a_server_plays_what_a_local_eval_plays(tiny_model, worker, tmp_path):
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    server = tmp_path / "server"
    config = _config(tiny_model, tmp_path / "client", steps=1, run_id="served")
    with running(create_app(worker, storage=str(server))) as url:
        tinkerless.train(config, backend=HTTPBackend(url))
        remote = evaluate(config.replace(backend=url), checkpoint="served@latest", samples=2, seed=9)
        with pytest.raises(UserError, match="run 'nope' does not exist"):
            evaluate(config.replace(backend=url), checkpoint="nope@1")
    assert remote.step == 1 and remote.episodes == 6
    # The same run read straight from the server's storage, played by a local worker.
    storage = next(server.rglob("runs/served/state.json")).parents[2]
    local = evaluate(config.replace(storage=str(storage)), checkpoint="served@1", samples=2, seed=9)
    for ours, theirs in zip(local.played, remote.played):
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)
        assert ours.reward == theirs.reward
    assert local.pass_at == remote.pass_at


def test_an_eval_larger_than_one_rollout_call_is_split(tiny_model, worker, tmp_path, monkeypatch):
    from tinkerless.sdk.evaluation import evaluate as evaluate_module
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running
    from tinkerless.server.limits import ServingLimits

    config = _config(tiny_model, tmp_path / "client")
    tasks = [{"word": w} for w in "abcde"]
    monkeypatch.setattr(evaluate_module, "MAX_EPISODES_PER_ROLLOUT", 4)  # as a server that allows 4 per call
    with running(create_app(worker, storage=str(tmp_path / "server"), limits=ServingLimits(max_rollouts=4))) as url:
        report = evaluate(config.replace(backend=url), tasks=tasks, samples=2, seed=4)
    assert report.episodes == 10 and report.errors == 0  # 3 calls of 2 tasks x 2 samples, 2, 1
    assert sorted(e.task_index for e in report.played) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for episode in report.played:
        assert f"say {tasks[episode.task_index]['word']}" in episode.transcript[0]["content"]
    # The first call is what an eval of its tasks alone plays: its seed is the eval's.
    first = evaluate(config, tasks=tasks[:2], samples=2, seed=4)
    for ours, theirs in zip(first.played, report.played[:4]):
        np.testing.assert_array_equal(ours.tokens, theirs.tokens)


def test_mistakes_are_refused_before_the_model_loads(run, tmp_path, monkeypatch):
    from tinkerless.sdk.evaluation import evaluate as evaluate_module

    config, _, _ = run

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was found")

    monkeypatch.setattr(evaluate_module, "make_backend", no_model)
    (tmp_path / "not-an-adapter").mkdir()
    cases = [
        (dict(checkpoint="evv@1"), UserError), (dict(checkpoint="ev@7"), StorageNotFound),
        (dict(checkpoint="ev@1", samples=0), ConfigError), (dict(adapter=str(tmp_path / "not-an-adapter")), UserError),
        (dict(transcripts=str(tmp_path)), UserError),
    ]
    for kwargs, error in cases:
        with pytest.raises(error):
            evaluate(config, **kwargs)
    with pytest.raises(UserError, match="was trained on base model"):
        evaluate(config.replace(model=build_tiny_model(tmp_path / "other", seed=2)), checkpoint="ev@1")
