"""`tinkerless.sft()` and `tinkerless sft`: a run like an RL run (metrics, plot, checkpoints, accounting,
listing, exact resume after SIGKILL), the same through `tinkerless serve`, and bad input that writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tinkerless.coordinator import list_runs
from tinkerless.errors import DatasetError, UserError
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.sft.loop import batch_indices, sft
from tinkerless.storage import CheckpointStore, ObjectStore

CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands"]


def _examples(count: int) -> list[dict]:
    return [
        {"messages": [{"role": "system", "content": "Repeat twice."}, {"role": "user", "content": f"word {i}"},
                      {"role": "assistant", "content": f"w{i} w{i}"}]}
        for i in range(count)
    ]


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _adapter(storage: Path, run_id: str, step: int) -> bytes:
    files = CheckpointStore(ObjectStore(str(storage)), f"runs/{run_id}/checkpoints").load(step).files
    return files["adapter/adapter_model.safetensors"]


def test_sft_run_lowers_nll_and_leaves_what_an_rl_run_leaves(tiny_model, tmp_path, capsys):
    from tinkerless.sdk.cli.commands import main

    result = sft(
        model=tiny_model, data=_examples(12), eval_fraction=0.25, steps=6, batch_size=3, eval_every=2,
        learning_rate=2e-2, checkpoint_every=3, storage=str(tmp_path), run_id="s1", progress=False, seed=1,
    )
    records = result.metrics
    assert [r["step"] for r in records] == list(range(6))
    assert records[-1]["train_nll"] < records[0]["train_nll"]  # it learns the replies
    evals = [r["eval_nll"] for r in records if "eval_nll" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]  # and generalises to the held-out split
    assert all(r["trained_tokens"] > 0 and r["compute_s/total"] > 0 for r in records)
    assert result.plot_path.is_file() and result.plot_path.stat().st_size > 1000
    assert result.usage["compute_seconds"]["update"] > 0 and result.usage["device"] == "cpu"
    # Verified checkpoints at 3 and 6, each a standard PEFT adapter plus the driver's state.
    store = CheckpointStore(ObjectStore(str(tmp_path)), "runs/s1/checkpoints")
    assert store.steps() == [3, 6]
    files = store.load(6).files
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors", "optimizer.pt", "client.json"} <= set(files)
    [run] = list_runs(ObjectStore(str(tmp_path)))
    assert run.status == "finished" and run.config["kind"] == "sft" and run.summary["train_nll_last"] is not None
    capsys.readouterr()
    assert main(["runs", "--storage", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.split()[:2] == ["s1", "finished"] and "SFT nll" in row and "step-6" in row


def test_batches_cover_each_epoch_once_in_a_seeded_order():
    first_epoch = [i for step in range(4) for i in batch_indices(step, 5, 20, seed=3)]
    assert sorted(first_epoch) == list(range(20)) and first_epoch != list(range(20))
    assert batch_indices(1, 5, 20, seed=3) == batch_indices(1, 5, 20, seed=3)
    assert batch_indices(4, 5, 20, seed=3) != batch_indices(0, 5, 20, seed=3)  # a new order each epoch


@pytest.mark.parametrize(
    "records, culprit",
    [
        ([{"messages": [{"role": "user", "content": "q"}]}], "no assistant turn"),
        ([{"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "a"}]}], "over max_length=64"),
    ],
)
def test_bad_data_fails_before_a_run_exists_and_keeps_earlier_runs(tiny_model, tmp_path, records, culprit):
    sft(model=tiny_model, data=_examples(4), steps=1, batch_size=2, storage=str(tmp_path), run_id="kept", progress=False)
    data = _write(tmp_path / "bad.jsonl", _examples(3) + records)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(DatasetError, match=culprit) as info:
        sft(model=tiny_model, data=str(data), max_length=64, storage=str(tmp_path), run_id="new", progress=False)
    assert "bad.jsonl, line 4" in str(info.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, nothing lost


def test_cli_reports_malformed_json_with_its_line_and_an_unknown_resume(tiny_model, tmp_path, capsys):
    from tinkerless.sdk.cli.commands import main

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_examples(1)[0]) + "\n{oops\n")
    assert main(["sft", str(data), "--model", tiny_model, "--storage", str(tmp_path), "--no-progress"]) == 2
    assert "d.jsonl, line 2: not valid JSON" in capsys.readouterr().err
    _write(data, _examples(2))
    code = main(["sft", str(data), "--model", tiny_model, "--storage", str(tmp_path), "--resume", "--run-id", "ghost", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "'ghost' does not exist" in err and "tinkerless runs" in err
    import tinkerless

    tinkerless.train(model=tiny_model, reward=lambda completion, task: 0.0, tasks=[{"prompt": "x"}], steps=1, batch_size=1,
                     group_size=2, max_tokens=2, storage=str(tmp_path), run_id="rl", progress=False)
    state = (tmp_path / "runs/rl/state.json").read_bytes()
    code = main(["sft", str(data), "--model", tiny_model, "--storage", str(tmp_path), "--resume", "--run-id", "rl", "--no-progress"])
    assert code == 2 and "'rl' is an RL run" in capsys.readouterr().err
    assert (tmp_path / "runs/rl/state.json").read_bytes() == state  # the RL run is left as it was


def _start_sft(data: Path, storage: Path, model: str, *extra: str) -> subprocess.Popen:
    cmd = [*CLI, "sft", str(data), "--model", model, "--storage", str(storage), "--run-id", "r", "--steps", "16",
           "--batch-size", "4", "--checkpoint-every", "1", "--keep-checkpoints", "100", "--learning-rate", "0.01",
           "--eval-every", "4", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKERLESS_HEARTBEAT_S": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkilled_sft_resumes_to_a_byte_identical_adapter(tiny_model, tmp_path):
    data = _write(tmp_path / "d.jsonl", _examples(24))
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    proc = _start_sft(data, killed, tiny_model)
    checkpoints = CheckpointStore(ObjectStore(str(killed)), "runs/r/checkpoints")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if (killed / "runs/r/checkpoints").exists() and (checkpoints.latest_step() or 0) >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads((killed / "runs/r/state.json").read_text())["status"] == "running"  # nothing could mark it
    killed_at = checkpoints.latest_step()
    assert killed_at is not None and killed_at < 16

    resumed = _start_sft(data, killed, tiny_model, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0 and "resumed from checkpoint" in out, out
    reference = _start_sft(data, straight, tiny_model)
    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out

    assert _adapter(killed, "r", 16) == _adapter(straight, "r", 16)
    lines = [json.loads(line) for line in (killed / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(16))  # no step twice, none missing
    straight_lines = [json.loads(line) for line in (straight / "runs/r/metrics.jsonl").read_text().splitlines()]
    assert [r["train_nll"] for r in lines] == [r["train_nll"] for r in straight_lines]


def test_sft_through_tinkerless_serve_matches_the_local_run(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    settings = dict(model=tiny_model, data=_examples(8), steps=3, batch_size=4, learning_rate=1e-2, checkpoint_every=3,
                    run_id="via-http", progress=False, eval_fraction=0.25, eval_every=1)
    local = sft(storage=str(tmp_path / "local"), backend=LocalBackend(tiny_model), **settings)
    with running(create_app(Worker(tiny_model), storage=str(tmp_path / "server"))) as url:
        remote = sft(storage=str(tmp_path / "client"), backend=HTTPBackend(url, timeout=300), **settings)
    assert [r["train_nll"] for r in remote.metrics] == [r["train_nll"] for r in local.metrics]
    assert [r["eval_nll"] for r in remote.metrics] == [r["eval_nll"] for r in local.metrics]
    # The server kept the run and its checkpoint (tenant "_" without auth), byte-identical to the local one.
    assert _adapter(tmp_path / "server/tenants/_", "via-http", 3) == _adapter(tmp_path / "local", "via-http", 3)


def test_export_episodes_writes_the_best_episodes_as_sft_data(tiny_model, tmp_path, capsys):
    from tinkerless.sdk.cli.commands import main
    from tinkerless.sdk.sft.data import read_jsonl, to_messages

    run_dir = tmp_path / "runs/rl"
    run_dir.mkdir(parents=True)
    def episode(step, reward, status="done", reply="ok"):
        return {"step": step, "task_index": 0, "status": status, "reward": reward,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]}
    _write(run_dir / "episodes.jsonl", [episode(0, 0.2), episode(0, 1.0), episode(1, 1.0), episode(1, 1.0, reply="other"),
                                         episode(1, 1.0, status="truncated"), episode(2, None, status="error")])
    (run_dir / "state.json").write_text(json.dumps({"config": {"transcripts_per_step": 4, "batch_size": 4, "group_size": 4}}))
    out = tmp_path / "best.jsonl"
    assert main(["export-episodes", "rl", str(out), "--min-reward", "0.5", "--storage", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 of 6 episodes" in printed and "1 duplicates" in printed and "1 truncated" in printed
    assert "kept 4 of its 16 episodes per step" in printed and "transcripts_per_step=16" in printed
    records = read_jsonl(out)
    assert [to_messages(r, "x")[-1]["content"] for _, r in records] == ["ok", "other"]
    # An existing file is never replaced without --overwrite; an unknown run names where it looked.
    before = out.read_bytes()
    assert main(["export-episodes", "rl", str(out), "--min-reward", "0.5", "--storage", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == before
    assert main(["export-episodes", "nope", str(tmp_path / "x.jsonl"), "--min-reward", "0", "--storage", str(tmp_path)]) == 2
    assert "no episodes for run 'nope'" in capsys.readouterr().err
    assert main(["export-episodes", "rl", str(tmp_path / "y.jsonl"), "--min-reward", "2", "--storage", str(tmp_path)]) == 2
    assert "nothing written" in capsys.readouterr().err and not (tmp_path / "y.jsonl").exists()


def test_export_then_sft_round_trip_from_a_real_rl_run(tiny_model, tmp_path, capsys):
    """Expert iteration on a real run: RL with every episode kept, export, SFT on the export."""
    import tinkerless
    from tinkerless.sdk.cli.commands import main

    rl = tinkerless.train(
        model=tiny_model, reward=lambda completion, task: float(len(completion) % 2), tasks=[{"prompt": "go"}],
        steps=1, batch_size=2, group_size=4, max_tokens=6, transcripts_per_step=8, storage=str(tmp_path),
        run_id="rl", progress=False, temperature=1.0,
    )
    out = tmp_path / "best.jsonl"
    assert main(["export-episodes", rl.run_id, str(out), "--min-reward", "1", "--storage", str(tmp_path), "--include-truncated"]) == 0
    assert "note:" not in capsys.readouterr().out  # every episode was kept
    result = sft(model=tiny_model, data=str(out), steps=1, batch_size=2, storage=str(tmp_path), progress=False, eval_fraction=0)
    assert np.isfinite(result.metrics[0]["train_nll"])


def test_unknown_sft_setting_is_named(tiny_model):
    from tinkerless.errors import ConfigError

    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        sft(model=tiny_model, data=_examples(2), learning_rte=1.0)
    with pytest.raises(ConfigError, match="needs data"):
        sft(model=tiny_model)
    with pytest.raises(UserError):
        sft(model=tiny_model, data=_examples(2), eval_fraction=1.5)


def test_train_resume_refuses_an_sft_run_and_leaves_it_as_it_was(tiny_model, tmp_path):
    import tinkerless

    tinkerless.sft(model=tiny_model, data=_examples(2), steps=1, batch_size=2, storage=str(tmp_path), run_id="sft1",
                   progress=False)
    state = (tmp_path / "runs/sft1/state.json").read_bytes()
    with pytest.raises(UserError, match="'sft1' is an SFT run") as info:
        tinkerless.train(model=tiny_model, reward=lambda completion, task: 0.0, tasks=[{"prompt": "x"}], steps=2,
                         batch_size=1, group_size=2, max_tokens=2, storage=str(tmp_path), run_id="sft1", resume=True,
                         progress=False)
    assert "init_from='sft1@latest'" in info.value.hint
    assert (tmp_path / "runs/sft1/state.json").read_bytes() == state
