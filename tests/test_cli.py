"""The `tinkerless` command: train, resume, runs and eval, in-process and through the installed script."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tinkerless.sdk.cli.commands import load_config, main
from tinkerless.sdk.run.metrics import read_metrics
from tinkerless.storage import CheckpointStore, ObjectStore
from tinkerless.coordinator import checkpoint_prefix

SCRIPT = Path(sys.executable).with_name("tinkerless")

EXAMPLE = """\
import tinkerless


@tinkerless.reward
def length_reward(completion, task):
    return float(len(completion) % 3)


config = tinkerless.TrainConfig(
    model={model!r},
    reward=length_reward,
    tasks=[{{"prompt": "2+3?"}}, {{"prompt": "1+1?"}}],
    steps=2,
    batch_size=2,
    group_size=2,
    max_tokens=4,
    storage={storage!r},
    checkpoint_every=1,
    progress=False,
)
"""

MEAN = re.compile(r"mean reward (-?\d+\.\d+|nan) over (\d+) episodes \((\d+) failed\)")


def write_example(directory: Path, model: str, storage: Path, name: str = "cli_example.py", body: str = EXAMPLE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(body.format(model=model, storage=str(storage)))
    return path


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_script(*argv: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tiny_model, tmp_path_factory):
    """An example file and a finished 2-step run `cli-run` made by `tinkerless train`."""
    root = tmp_path_factory.mktemp("cli")
    storage = root / "store"
    file = write_example(root / "src", tiny_model, storage)
    assert main(["train", str(file), "--run-id", "cli-run", "--no-progress"]) == 0
    return file, storage


# ---- train / runs --------------------------------------------------------------------------------


def test_train_writes_metrics_plot_and_checkpoints(trained):
    _, storage = trained
    run_dir = storage / "runs" / "cli-run"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    png = run_dir / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert CheckpointStore(ObjectStore(str(storage)), checkpoint_prefix("cli-run")).steps() == [1, 2]


def test_runs_lists_the_run_with_status_and_step(trained, capsys):
    _, storage = trained
    code, out, _ = run_main(capsys, "runs", "--storage", storage)
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert "STATUS" in header and "STEP" in header
    (row,) = [r for r in rows if r.startswith("cli-run ")]
    assert row.split()[1] == "finished"
    assert "2/2" in row and "step-2" in row


def test_runs_on_empty_storage(tmp_path, capsys):
    code, out, _ = run_main(capsys, "runs", "--storage", tmp_path)
    assert code == 0 and out.strip() == f"no runs in {tmp_path}"


@pytest.fixture(scope="module")
def resumed(trained, tmp_path_factory):
    """A copy of the trained run, continued to 3 steps by the installed `tinkerless` script."""
    file, storage = trained
    copy = tmp_path_factory.mktemp("resumed") / "store"
    shutil.copytree(storage, copy)
    proc = run_script("train", file, "--resume", "--run-id", "cli-run", "--steps", "3", "--storage", copy, "--no-progress")
    assert proc.returncode == 0, proc.stderr
    return copy


def test_resume_continues_the_run(resumed):
    run_dir = resumed / "runs" / "cli-run"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert CheckpointStore(ObjectStore(str(resumed)), checkpoint_prefix("cli-run")).latest_step() == 3
    out = run_script("runs", "--storage", resumed).stdout
    (row,) = [r for r in out.splitlines() if r.startswith("cli-run ")]
    assert row.split()[1] == "finished" and "step-3" in row and " 3/" in row


def test_runs_shows_the_new_total_after_resume(resumed, capsys):
    code, out, _ = run_main(capsys, "runs", "--storage", resumed)
    (row,) = [r for r in out.splitlines() if r.startswith("cli-run ")]
    assert "3/3" in row


# ---- eval ------------------------------------------------------------------------------------------


def parse_mean(out: str) -> tuple[float, int, int]:
    match = MEAN.search(out)
    assert match, out
    return float(match.group(1)), int(match.group(2)), int(match.group(3))


def test_eval_run_checkpoint_prints_mean_reward(trained, capsys):
    file, _ = trained
    code, out, err = run_main(capsys, "eval", file, "--run-id", "cli-run", "--episodes", "4")
    assert code == 0, err
    assert out.startswith("run cli-run: mean reward")
    mean, episodes, failed = parse_mean(out)
    assert episodes == 4 and failed == 0
    assert 0.0 <= mean <= 2.0  # length % 3
    assert out.count("  sample: ") == 3


def test_eval_with_materialized_peft_adapter(trained, tmp_path, capsys):
    file, storage = trained
    checkpoints = CheckpointStore(ObjectStore(str(storage)), checkpoint_prefix("cli-run"))
    checkpoints.materialize(2, str(tmp_path / "ckpt"))
    adapter = tmp_path / "ckpt" / "adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()

    code, out, err = run_main(capsys, "eval", file, "--adapter", adapter, "--episodes", "4")
    assert code == 0, err
    assert out.startswith(f"{adapter}: mean reward")
    from_adapter = parse_mean(out)
    assert from_adapter[1:] == (4, 0)

    # the same weights through the run checkpoint give the same evaluation (same seed)
    code, out, err = run_main(capsys, "eval", file, "--run-id", "cli-run", "--step", "2", "--episodes", "4")
    assert code == 0, err
    assert out.startswith("run cli-run step 2: mean reward")
    assert parse_mean(out) == from_adapter


def test_eval_base_model(trained, tiny_model, capsys):
    file, _ = trained
    code, out, err = run_main(capsys, "eval", file, "--episodes", "2", "--temperature", "0.5")
    assert code == 0, err
    assert out.startswith(f"base model {tiny_model}: mean reward")
    assert parse_mean(out)[1:] == (2, 0)


# ---- errors ------------------------------------------------------------------------------------------


def assert_cli_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    # library progress bars (e.g. transformers' "Loading weights") may come first on stderr
    start = err.find("tinkerless: error: ")
    assert start != -1 and (start == 0 or err[start - 1] == "\n"), err
    message = err[start:]
    assert "Traceback" not in message.split("\n", 1)[0]
    for fragment in fragments:
        assert fragment in message, err


def test_missing_file(tmp_path, capsys):
    for command in ("train", "eval"):
        code, _, err = run_main(capsys, command, tmp_path / "nope.py")
        assert_cli_error(code, err, "nope.py does not exist", "hint:")


def test_file_without_config(tmp_path, capsys):
    file = tmp_path / "no_config.py"
    file.write_text("x = 1\n")
    code, _, err = run_main(capsys, "train", file)
    assert_cli_error(code, err, "must define `config = tinkerless.TrainConfig(...)`")


def test_file_with_two_unnamed_configs(tiny_model, tmp_path, capsys):
    body = EXAMPLE.replace("config = ", "first = ") + "second = first\nthird = tinkerless.TrainConfig()\n"
    file = write_example(tmp_path, tiny_model, tmp_path / "store", name="two_configs.py", body=body)
    code, _, err = run_main(capsys, "train", file)
    assert_cli_error(code, err, "must define `config")


def test_single_config_under_another_name_is_found(tiny_model, tmp_path):
    body = EXAMPLE.replace("config = ", "my_run = ")
    file = write_example(tmp_path, tiny_model, tmp_path / "store", name="other_name.py", body=body)
    config = load_config(str(file))
    assert config.model == tiny_model and config.steps == 2 and config.reward.__name__ == "length_reward"


def test_eval_unknown_run(trained, capsys):
    file, _ = trained
    code, _, err = run_main(capsys, "eval", file, "--run-id", "no-such-run", "--episodes", "2")
    assert_cli_error(code, err, "run 'no-such-run' does not exist", "tinkerless runs")


def test_eval_adapter_dir_without_config(trained, tmp_path, capsys):
    file, _ = trained
    (tmp_path / "not-an-adapter").mkdir()
    (tmp_path / "not-an-adapter" / "weights.bin").write_bytes(b"\x00")
    code, _, err = run_main(capsys, "eval", file, "--adapter", tmp_path / "not-an-adapter")
    assert_cli_error(code, err, "is not a PEFT adapter directory")


def test_train_config_error_from_flags(trained, tmp_path, capsys):
    file, _ = trained
    code, _, err = run_main(capsys, "train", file, "--loss", "nope", "--storage", tmp_path)
    assert_cli_error(code, err, "unknown loss 'nope'", "hint:")
    code, _, err = run_main(capsys, "train", file, "--steps", "0", "--storage", tmp_path)
    assert_cli_error(code, err, "steps must be at least 1")
    assert not (tmp_path / "runs").exists()


def test_train_where_every_episode_fails(tiny_model, tmp_path, capsys):
    body = EXAMPLE.replace("return float(len(completion) % 3)", "return 'not a number'")
    file = write_example(tmp_path, tiny_model, tmp_path / "store", name="bad_reward.py", body=body)
    code, _, err = run_main(capsys, "train", file, "--run-id", "bad")
    assert_cli_error(code, err, "episodes failed at step 0", "length_reward returned 'not a number'")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train"])
    assert info.value.code == 2
    assert "the following arguments are required: file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_user_file_that_fails_to_import(tmp_path, capsys):
    file = tmp_path / "broken_example.py"
    file.write_text("import tinkerless\nconfig = tinkerless.TrainConfig(\n")
    code, _, err = run_main(capsys, "train", file)
    assert_cli_error(code, err, "broken_example.py")


def test_installed_script_reports_errors(tmp_path):
    proc = run_script("eval", tmp_path / "missing.py")
    assert proc.returncode == 2
    assert proc.stderr.startswith("tinkerless: error: ") and "missing.py does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
