"""`eval_every=N`: held-out eval reward and pass@k in metrics.jsonl and the plot; eval episodes never train."""

from __future__ import annotations

import pytest
from safetensors.torch import load as load_safetensors

import tinkerless
from tinkerless.coordinator import checkpoint_prefix
from tinkerless.errors import ConfigError, DatasetError
from tinkerless.sdk.evaluation.evaluate import evaluate
from tinkerless.sdk.run.metrics import MetricsWriter, plot_metrics
from tinkerless.storage import CheckpointStore, ObjectStore


def _letters(completion, task):
    """Varies with what was sampled, so groups differ and every step trains."""
    return (sum(map(ord, completion)) % 5) / 4


HELD_OUT = [{"prompt": "held out one"}, {"prompt": "held out two"}, {"prompt": "held out three"}]


def _train(tiny_model, storage, **extra):
    settings = dict(
        model=tiny_model, reward=_letters, tasks=[{"prompt": "a"}, {"prompt": "b"}], steps=3, batch_size=2,
        group_size=2, max_tokens=4, temperature=1.0, learning_rate=0.05, storage=str(storage), progress=False,
        run_id="ee", checkpoint_every=1, keep_checkpoints=None, seed=5,
    )
    return tinkerless.train(**{**settings, **extra})


def _adapter(storage, step: int) -> dict:
    checkpoint = CheckpointStore(ObjectStore(str(storage)), checkpoint_prefix("ee")).load(step)
    return load_safetensors(checkpoint.files["adapter/adapter_model.safetensors"])


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """The same run twice: with eval_every=2 on held-out tasks, and without."""
    with_eval, without = tmp_path_factory.mktemp("with-eval"), tmp_path_factory.mktemp("without-eval")
    evaluated = _train(tiny_model, with_eval, eval_every=2, eval_tasks=HELD_OUT)
    plain = _train(tiny_model, without)
    return evaluated, plain, with_eval, without


def test_eval_columns_on_every_nth_step(runs):
    evaluated, plain, _, _ = runs
    eval_steps = [r["step"] for r in evaluated.metrics if "eval_reward_mean" in r]
    assert eval_steps == [0, 2]
    for record in evaluated.metrics:
        if record["step"] in eval_steps:
            assert record["eval_episodes"] == len(HELD_OUT) * 2 and record["eval_errors"] == 0
            assert 0.0 <= record["eval_pass@1"] <= record["eval_pass@2"] <= 1.0
            assert 0.0 <= record["eval_reward_mean"] <= 1.0
    assert not any(k.startswith("eval_") for r in plain.metrics for k in r)


def test_eval_episodes_never_train(runs):
    evaluated, plain, with_eval, without = runs
    # Same training rewards and bit-identical adapters at every step: the held-out episodes changed nothing.
    assert [r["reward_mean"] for r in evaluated.metrics] == [r["reward_mean"] for r in plain.metrics]
    assert [r["trained_sequences"] for r in evaluated.metrics] == [r["trained_sequences"] for r in plain.metrics]
    for step in (1, 2, 3):
        ours, theirs = _adapter(with_eval, step), _adapter(without, step)
        assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    assert any((_adapter(with_eval, 3)[k] != _adapter(with_eval, 1)[k]).any() for k in _adapter(with_eval, 1))


def test_the_logged_eval_is_tinkerless_eval_of_that_steps_checkpoint(runs, tiny_model):
    evaluated, _, with_eval, _ = runs
    logged = next(r for r in evaluated.metrics if r["step"] == 2)
    config = tinkerless.TrainConfig(model=tiny_model, reward=_letters, tasks=HELD_OUT, group_size=2, max_tokens=4,
                                    temperature=1.0, storage=str(with_eval), seed=5)
    report = evaluate(config, checkpoint="ee@2", seed=5)  # the adapter step 2 sampled from, the same seed
    assert report.mean == pytest.approx(logged["eval_reward_mean"])
    assert report.pass_at[1] == pytest.approx(logged["eval_pass@1"])


def test_a_resumed_run_logs_the_evals_of_an_uninterrupted_one(runs, tiny_model, tmp_path):
    evaluated = runs[0]
    _train(tiny_model, tmp_path, steps=2, eval_every=2, eval_tasks=HELD_OUT)  # stops after step 1
    resumed = _train(tiny_model, tmp_path, steps=3, eval_every=2, eval_tasks=HELD_OUT, resume=True)  # plays step 2

    def columns(metrics):
        return [(r["step"], r["reward_mean"], r.get("eval_reward_mean"), r.get("eval_pass@1")) for r in metrics]

    assert columns(resumed.metrics) == columns(evaluated.metrics)


def test_the_plot_shows_eval_reward_and_pass_at_1(tmp_path):
    import matplotlib.image

    rows = [{"step": s, "reward_mean": 0.1 * s, "loss": 0.5} for s in range(4)]
    plain, evaluated = tmp_path / "plain.jsonl", tmp_path / "eval.jsonl"
    for path, extra in ((plain, {}), (evaluated, {"eval_reward_mean": 0.9, "eval_pass@1": 0.5})):
        writer = MetricsWriter(path)
        for row in rows:
            writer.log({**row, **(extra if row["step"] % 2 == 0 else {})})
    images = {p: matplotlib.image.imread(plot_metrics(p, p.with_suffix(".png"))) for p in (plain, evaluated)}
    assert images[evaluated].shape[0] > images[plain].shape[0]  # an eval_pass@1 panel below the others

    def orange_pixels(image):  # the eval series is drawn in tab:orange (#ff7f0e)
        rgb = image[..., :3]
        return int(((abs(rgb[..., 0] - 1.0) < 0.02) & (abs(rgb[..., 1] - 0.498) < 0.02) & (abs(rgb[..., 2] - 0.055) < 0.02)).sum())

    assert orange_pixels(images[plain]) == 0 and orange_pixels(images[evaluated]) > 50


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_eval_every_is_validated(tiny_model, tmp_path, bad):
    with pytest.raises(ConfigError, match="eval_every must be a whole number"):
        _train(tiny_model, tmp_path, eval_every=bad, eval_tasks=HELD_OUT)


def test_eval_every_needs_held_out_tasks(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="eval_every needs held-out tasks") as caught:
        _train(tiny_model, tmp_path, eval_every=2)
    assert "eval_tasks=" in caught.value.hint
    with pytest.raises(DatasetError, match="eval_tasks: the task dataset is empty"):
        _train(tiny_model, tmp_path, eval_every=2, eval_tasks=[])
    assert not (tmp_path / "runs").exists()  # refused before the run was created


def test_eval_every_through_a_server(tiny_model, worker, tmp_path):
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    with running(create_app(worker, storage=str(tmp_path / "server"))) as url:
        result = _train(tiny_model, tmp_path / "client", steps=1, eval_every=1, eval_tasks=HELD_OUT, backend=HTTPBackend(url))
    (record,) = result.metrics
    assert record["eval_episodes"] == 6 and "eval_pass@1" in record and "eval_reward_mean" in record


def test_train_cli_takes_eval_every(tiny_model, tmp_path, capsys):
    from tinkerless.sdk.cli.commands import main
    from tinkerless.sdk.run.metrics import read_metrics

    file = tmp_path / "held_out.py"
    file.write_text(
        "import tinkerless\nfrom test_eval_every import HELD_OUT, _letters\n"
        f"config = tinkerless.TrainConfig(model={tiny_model!r}, reward=_letters, tasks=[{{'prompt': 'a'}}], eval_tasks=HELD_OUT,\n"
        f"    steps=1, batch_size=1, group_size=2, max_tokens=4, storage={str(tmp_path)!r}, progress=False)\n"
    )
    assert main(["train", str(file), "--run-id", "cli", "--eval-every", "1"]) == 0
    (record,) = read_metrics(tmp_path / "runs" / "cli" / "metrics.jsonl")
    assert record["eval_episodes"] == 6
    assert main(["train", str(file), "--run-id", "cli2", "--eval-every", "0"]) == 2
    assert "eval_every must be a whole number" in capsys.readouterr().err
