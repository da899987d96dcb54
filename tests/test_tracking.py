"""`report_to`: W&B (offline), TensorBoard and MLflow (a local store) get every step once, read back from each.

Also: a resumed run continues the same tracker runs without a step twice; a tracker that raises leaves the
run (and its adapter) as it is and is noted in metrics.jsonl; a tracker that is not installed, or a name
that is none, is a ConfigError before any model loads; SFT and eval runs; `--report-to` on the command line.
"""

from __future__ import annotations

import glob
import json
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from conftest import write_resumable_example

import tinkerless
from tinkerless.errors import ConfigError
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.run.metrics import read_metrics, reward_summary
from tinkerless.sdk.tracking import TRACKERS, TrackerWarning, open_trackers
from tinkerless.sdk.tracking.base import TrackerSpec, scalar_metrics

# MLflow's sqlite store, on SQLAlchemy 2.1
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

ALL = ["wandb", "tensorboard", "mlflow"]
TASKS = [{"prompt": "hi"}, {"prompt": "ho"}]


def _reward(completion: str, task: dict) -> float:
    return float(len(completion) % 3 == 0)


def _settings(model: str, storage: Path, **extra) -> dict:
    settings = dict(model=model, reward=_reward, tasks=TASKS, steps=4, batch_size=2, group_size=2, max_tokens=4,
                    progress=False, checkpoint_every=2, seed=3, storage=str(storage), run_id="r", transcripts_per_step=2,
                    learning_rate=5e-2, temperature=1.0)
    return {**settings, **extra}


def _offline(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B offline with every file under `root`; MLflow's store there too."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        mp.setenv(name, str(root / "wandb-home"))
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    mp.setenv("WANDB_CONSOLE", "off")
    mp.setenv("WANDB_ERROR_REPORTING", "false")
    mp.setenv("WANDB_PROJECT", "tinkerless-tests")
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    mp.setenv("MLFLOW_EXPERIMENT_NAME", "tests")


# ---- reading each tracker back --------------------------------------------------------------------
def _offline_dirs(root: Path, run_id: str) -> list[str]:
    """W&B's offline run directories of `run_id` (a second one in the same second gets a `-1` suffix), oldest first."""
    found = glob.glob(str(root / "wandb-home" / "wandb" / f"offline-run-*-{run_id}*" / f"run-{run_id}.wandb"))
    return sorted(found, key=lambda f: Path(f).stat().st_mtime)


def wandb_run(root: Path, run_id: str, steps: int | None = None) -> dict:
    """History rows, config and summary of W&B run `run_id`, from every offline run directory it has.

    W&B's own process writes the files: after `finish()` the last records can take a moment to land, so
    with `steps` it reads again (a few seconds at most) until that many history rows are there."""
    deadline = time.monotonic() + 10
    while True:
        out = _read_wandb_run(root, run_id)
        if steps is None or len(out["history"]) >= steps or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _read_wandb_run(root: Path, run_id: str) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    files = _offline_dirs(root, run_id)
    assert files, f"no offline W&B run {run_id} under {root}"
    out: dict = {"history": [], "config": {}, "summary": {}}
    for file in files:
        store = datastore.DataStore()
        store.open_for_scan(file)
        while (data := store.scan_data()) is not None:
            record = pb.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            items = {"history": lambda: record.history.item, "summary": lambda: record.summary.update,
                     "config": lambda: record.config.update, "run": lambda: record.run.config.update}.get(kind)
            if items is None:
                continue
            values = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items()}
            if kind == "history":
                out["history"].append(values)
            else:
                out["summary" if kind == "summary" else "config"].update(values)
    return out


def tensorboard_scalars(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    events.Reload()
    return events


def mlflow_client():
    from mlflow.tracking import MlflowClient

    return MlflowClient()


def _run_id_in(run_dir: Path, tracker: str) -> dict:
    return json.loads((run_dir / "trackers.json").read_text())[tracker]


# ---- one run with every tracker, read back from each --------------------------------------------
@pytest.fixture(scope="module")
def tracked(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp, root)
        mp.chdir(root)  # a sqlite store keeps its artifacts in ./mlruns
        result = tinkerless.train(**_settings(tiny_model, root / "store", report_to=ALL))
        yield root, result, read_metrics(result.run_dir / "metrics.jsonl"), tiny_model


def test_wandb_offline_run_holds_every_step_the_config_summary_and_transcripts(tracked):
    root, result, records, model = tracked
    run = wandb_run(root, _run_id_in(result.run_dir, "wandb")["id"], steps=4)
    rows = {row["_step"]: row for row in run["history"]}
    assert sorted(rows) == [0, 1, 2, 3] and len(run["history"]) == 4
    for record in records:
        row = rows[record["step"]]
        for key in ("reward_mean", "sampled_tokens", "compute_s/total", "policy_version"):
            assert row[key] == pytest.approx(record[key]), key
        assert row["transcripts/_type"] == "table-file" and row["transcripts/nrows"] == 2  # every step: 4 steps < 10
    config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in run["config"].items()}
    assert config["model"] == model
    assert config["tinkerless_version"] == tinkerless.__version__ and config["backend_kind"] == "local"
    assert config["steps"] == 4 and config["run_id"] == "r"
    summary = run["summary"]
    assert summary["usage/compute_seconds_total"] == pytest.approx(result.usage["compute_seconds_total"])
    assert summary["usage/device"] == "cpu" and "usage/cost_usd" in summary
    assert summary["reward_last"] == pytest.approx(reward_summary(records)["reward_last"])
    assert summary["plot/metrics"]["_type"] == "image-file"  # the run's PNG


def test_tensorboard_events_hold_each_metric_at_every_step(tracked):
    _, result, records, model = tracked
    events = tensorboard_scalars(result.run_dir / "tensorboard")
    logged = {(tag, s.step): s.value for tag in events.Tags()["scalars"] for s in events.Scalars(tag)}
    expected = {(key, r["step"]): value for r in records for key, value in r.items()
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
    assert logged.keys() == expected.keys()  # every number metrics.jsonl has, at its step, and nothing else
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert [s.step for s in events.Scalars("reward_mean")] == [0, 1, 2, 3]
    tags = events.Tags()
    assert {"transcripts/text_summary", "config/text_summary", "summary/text_summary"} <= set(tags["tensors"])
    assert tags["images"] == ["plot/metrics"]
    text = events.Tensors("transcripts/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "assistant:" in text and "reward" in text


def test_mlflow_store_holds_params_metrics_per_step_and_artifacts(tracked):
    root, result, records, model = tracked
    with pytest.MonkeyPatch.context() as mp:
        _offline(mp, root)
        mp.chdir(root)
        client = mlflow_client()
        run_id = _run_id_in(result.run_dir, "mlflow")["run_id"]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "r"
        params = run.data.params
        assert params["steps"] == "4" and params["model"] == model and params["tinkerless_version"] == tinkerless.__version__
        assert run.data.tags["tinkerless.backend"] == "local"
        history = client.get_metric_history(run_id, "reward_mean")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
            [(r["step"], pytest.approx(r["reward_mean"])) for r in records]
        assert [m.step for m in client.get_metric_history(run_id, "compute_s/total")] == [0, 1, 2, 3]
        artifacts = {a.path for a in client.list_artifacts(run_id)}
        assert {"metrics.png", "summary.json", "transcripts"} <= artifacts
        tables = [a.path for a in client.list_artifacts(run_id, "transcripts")]
        assert tables == [f"transcripts/step-{s:06d}.jsonl" for s in range(4)]
        local = Path(client.download_artifacts(run_id, "metrics.png", str(root / "dl")))
        assert local.read_bytes() == (result.run_dir / "metrics.png").read_bytes()
        summary = json.loads(Path(client.download_artifacts(run_id, "summary.json", str(root / "dl"))).read_text())
        assert summary["usage"]["compute_seconds_total"] == pytest.approx(result.usage["compute_seconds_total"])
        assert not any("tracker_error" in r for r in records)


# ---- resume ---------------------------------------------------------------------------------------
class DiesAtRollout(LocalBackend):
    """A local backend whose `die_at`-th rollout call raises, as if the client died inside that step."""

    def __init__(self, model: str, die_at: int):
        super().__init__(model)
        self.rollouts, self.die_at = 0, die_at

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        if method == "rollout":
            self.rollouts += 1
            if self.rollouts == self.die_at:
                raise RuntimeError("the client died here")
        return super().call_bytes(method, payload)


def test_a_run_stopped_and_resumed_has_each_step_once_in_every_tracker(tiny_model, tmp_path, monkeypatch):
    _offline(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")  # the file store: no database to set up
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    settings = _settings(tiny_model, tmp_path / "store", steps=5, report_to=ALL)
    # Dies in step 3: steps 0-2 are logged (to metrics.jsonl and every tracker), the checkpoint is step-2's.
    with pytest.raises(RuntimeError, match="died"):
        tinkerless.train(**settings, backend=DiesAtRollout(tiny_model, die_at=4))
    run_dir = tmp_path / "store" / "runs" / "r"
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    first = json.loads((run_dir / "trackers.json").read_text())
    assert {name: first[name]["last_step"] for name in ALL} == dict.fromkeys(ALL, 2)

    tinkerless.train(**settings, resume=True)  # resumes from step-2: replays step 2, then 3 and 4
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    state = json.loads((run_dir / "trackers.json").read_text())
    assert state["wandb"]["id"] == first["wandb"]["id"] and state["mlflow"]["run_id"] == first["mlflow"]["run_id"]

    history = wandb_run(tmp_path, state["wandb"]["id"], steps=5)["history"]  # two offline runs of one W&B run
    assert sorted(row["_step"] for row in history) == [0, 1, 2, 3, 4]
    assert len(_offline_dirs(tmp_path, state["wandb"]["id"])) == 2
    events = tensorboard_scalars(run_dir / "tensorboard")
    assert [s.step for s in events.Scalars("reward_mean")] == [0, 1, 2, 3, 4]
    client = mlflow_client()
    assert sorted(m.step for m in client.get_metric_history(state["mlflow"]["run_id"], "reward_mean")) == [0, 1, 2, 3, 4]
    assert client.get_run(state["mlflow"]["run_id"]).info.status == "FINISHED"
    assert len(client.search_runs([client.get_run(state["mlflow"]["run_id"]).info.experiment_id])) == 1


def test_a_run_sigkilled_and_resumed_has_each_step_once_in_every_tracker(tiny_model, tmp_path, monkeypatch):
    """A real kill: W&B's own process dies with the records it had not written, and the resume sends them again."""
    _offline(monkeypatch, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)  # each process its own W&B service, as from a shell
    example = write_resumable_example(tmp_path / "resumable.py", tiny_model, 6)
    run_dir = tmp_path / "store" / "runs" / "r"
    cmd = [sys.executable, "-m", "tinkerless.sdk.cli.commands", "train", str(example), "--storage", str(tmp_path / "store"),
           "--run-id", "r", "--no-progress", "--report-to", "wandb,tensorboard", "--report-to", "mlflow"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads((run_dir / "trackers.json").read_text())["mlflow"]["last_step"] >= 2:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.02)
    time.sleep(random.uniform(0.0, 0.1))  # anywhere inside the following step
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[0]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr

    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(6))
    state = json.loads((run_dir / "trackers.json").read_text())
    assert len(state["wandb"]["offline_files"]) == 2  # one W&B run, written by two processes
    assert sorted(row["_step"] for row in wandb_run(tmp_path, state["wandb"]["id"], steps=6)["history"]) == list(range(6))
    assert [s.step for s in tensorboard_scalars(run_dir / "tensorboard").Scalars("reward_mean")] == list(range(6))
    history = mlflow_client().get_metric_history(state["mlflow"]["run_id"], "reward_mean")
    assert sorted(m.step for m in history) == list(range(6))


def test_a_modal_runs_metrics_logged_twice_are_in_each_tracker_once(tmp_path, monkeypatch):
    from tinkerless.sdk.tracking.runs import report_modal_run

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    config = tinkerless.TrainConfig(reward=_reward, tasks=TASKS, report_to=["tensorboard", "mlflow"])
    records = [{"step": s, "reward_mean": s / 10} for s in range(3)]
    for shown in (records[:2], records):  # a Modal run, then the same run resumed and extended
        report_modal_run(config.report_to, config=config, run_id="m", run_dir=tmp_path / "runs" / "m", records=shown,
                         summary={"steps": len(shown)}, plot=None)
    assert [(s.step, s.value) for s in tensorboard_scalars(tmp_path / "runs/m/tensorboard").Scalars("reward_mean")] == \
        [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.2))]
    run_id = _run_id_in(tmp_path / "runs" / "m", "mlflow")["run_id"]
    assert sorted(m.step for m in mlflow_client().get_metric_history(run_id, "reward_mean")) == [0, 1, 2]


# ---- a tracker that fails ---------------------------------------------------------------------------
class Failing:
    """A tracker that raises in `fails` (every method by default), and counts what it was sent."""

    def __init__(self, name: str, fails: set[str] | None = None, from_step: int = 0):
        self.name, self.fails, self.from_step, self.holds_through, self.steps = name, fails, from_step, -1, []

    def _maybe(self, method: str, step: int = 0) -> None:
        if (self.fails is None or method in self.fails) and step >= self.from_step:
            raise ConnectionError(f"{self.name} is unreachable")

    def log_config(self, config): self._maybe("log_config")
    def log_metrics(self, step, metrics): self._maybe("log_metrics", step); self.steps.append(step)
    def log_transcripts(self, step, rows): self._maybe("log_transcripts", step)
    def log_summary(self, summary): self._maybe("log_summary")
    def log_artifact(self, path): self._maybe("log_artifact")
    def state(self): return {}
    def close(self, status="finished"): self._maybe("close")


def _fake(monkeypatch, name: str, make) -> None:
    class Spec(TrackerSpec):
        def opener(self):
            return make

    monkeypatch.setitem(TRACKERS, name, Spec(name, "json", name, "unused"))  # "json" is installed everywhere


def _adapter(storage: Path, step: int) -> bytes:
    return (storage / "runs/r/checkpoints" / f"step-{step}" / "adapter/adapter_model.safetensors").read_bytes()


def test_trackers_that_raise_leave_the_run_and_its_adapter_as_without_them(tiny_model, tmp_path, monkeypatch):
    tinkerless.train(**_settings(tiny_model, tmp_path / "plain", steps=3))
    made: dict[str, Failing] = {}

    def every_call(context):
        made["wandb"] = Failing("wandb")
        return made["wandb"]

    def from_step_1(context):
        made["mlflow"] = Failing("mlflow", {"log_metrics"}, from_step=1)
        return made["mlflow"]

    def at_the_end(context):
        made["tensorboard"] = Failing("tensorboard", {"log_summary"})
        return made["tensorboard"]

    for name, make in (("wandb", every_call), ("mlflow", from_step_1), ("tensorboard", at_the_end)):
        _fake(monkeypatch, name, make)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = tinkerless.train(**_settings(tiny_model, tmp_path / "tracked", steps=3, report_to=ALL))
    assert _adapter(tmp_path / "tracked", 3) == _adapter(tmp_path / "plain", 3)
    assert [r["step"] for r in result.metrics] == [0, 1, 2]
    said = [str(w.message) for w in caught if issubclass(w.category, TrackerWarning)]
    assert len(said) == 3 and all("off for the rest of this run" in s for s in said)  # once per tracker
    lines = read_metrics(tmp_path / "tracked" / "runs/r/metrics.jsonl")
    assert lines[0]["tracker_error"] == [{"tracker": "wandb", "during": "log_config", "error": "ConnectionError: wandb is unreachable"}]
    assert [e["tracker"] for e in lines[1]["tracker_error"]] == ["mlflow"] and "tracker_error" not in lines[2]
    assert lines[3] == {"tracker_error": [{"tracker": "tensorboard", "during": "log_summary",
                                           "error": "ConnectionError: tensorboard is unreachable"}]}
    assert made["wandb"].steps == [] and made["mlflow"].steps == [0] and made["tensorboard"].steps == [0, 1, 2]


def test_a_tracker_that_fails_to_open_is_off_and_noted_on_the_first_step(tmp_path, monkeypatch):
    def broken(context):
        raise RuntimeError("MLflow store full")

    _fake(monkeypatch, "mlflow", broken)
    with pytest.warns(TrackerWarning, match="'mlflow' failed in open"):
        trackers = open_trackers(["mlflow"], run_id="x", run_dir=tmp_path, kind="train")
    assert not trackers
    record = {"step": 0, "reward_mean": 1.0}
    trackers.log_step(record)
    assert record["tracker_error"] == [{"tracker": "mlflow", "during": "open", "error": "RuntimeError: MLflow store full"}]


# ---- checks before any model loads ------------------------------------------------------------------
def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the config was checked")


@pytest.mark.parametrize("name,extra", [("wandb", "wandb"), ("tensorboard", "tensorboard"), ("mlflow", "mlflow")])
def test_a_tracker_that_is_not_installed_is_a_config_error_naming_its_extra(tmp_path, monkeypatch, name, extra):
    monkeypatch.setitem(sys.modules, TRACKERS[name].package, None)  # as if it were not installed
    monkeypatch.setattr("tinkerless.sdk.run.trainer.make_backend", _no_model)
    monkeypatch.setattr("tinkerless.sdk.sft.loop.make_backend", _no_model)
    monkeypatch.setattr("tinkerless.sdk.evaluation.evaluate.make_backend", _no_model)
    for run in (
        lambda: tinkerless.train(**_settings("tiny", tmp_path, report_to=[name])),
        lambda: tinkerless.sft(data=[{"prompt": "a", "completion": "b"}], storage=str(tmp_path), report_to=name),
        lambda: tinkerless.evaluate(tinkerless.TrainConfig(reward=_reward, tasks=TASKS, report_to=[name])),
    ):
        with pytest.raises(ConfigError) as caught:
            run()
        assert f"report_to names {name!r}" in caught.value.message and "not installed" in caught.value.message
        assert caught.value.hint == f"pip install 'tinkerless[{extra}]'"
    assert not (tmp_path / "runs").exists()


def test_an_unknown_tracker_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown tracker 'wandbb' in report_to \(did you mean 'wandb'\?\)"):
        tinkerless.train(**_settings("tiny", tmp_path, report_to=["wandbb"]))
    with pytest.raises(ConfigError, match="report_to must be a list"):
        tinkerless.train(**_settings("tiny", tmp_path, report_to=[1]))


def test_report_to_on_the_command_line(tmp_path, capsys):
    from tinkerless.sdk.cli.commands import _parser, main

    parser = _parser()
    assert parser.parse_args(["train", "f.py"]).report_to is None  # the file's report_to stays
    assert parser.parse_args(["train", "f.py", "--report-to", "wandb,tensorboard", "--report-to", "mlflow"]).report_to == ALL
    assert parser.parse_args(["train", "f.py", "--report-to", "none"]).report_to == []  # clears the file's
    assert parser.parse_args(["sft", "d.jsonl", "--report-to", "tensorboard"]).report_to == ["tensorboard"]
    assert parser.parse_args(["eval", "f.py", "--report-to", "MLflow"]).report_to == ["mlflow"]
    file = tmp_path / "f.py"
    file.write_text("import tinkerless\nconfig = tinkerless.TrainConfig(reward=lambda c, t: 0.0, tasks=[{'prompt': 'x'}])\n")
    assert main(["train", str(file), "--report-to", "comet"]) == 2
    assert "unknown tracker 'comet'" in capsys.readouterr().err


def test_multi_agent_columns_go_under_each_policys_prefix():
    record = {"step": 3, "reward_mean": 0.5, "reward_mean/alice": 1.0, "win_rate/bob": 0.25, "compute_s/total": 2,
              "sample": "text", "kl": None, "errors": [], "flag": True}
    assert scalar_metrics(record, ("alice", "bob")) == {
        "reward_mean": 0.5, "alice/reward_mean": 1.0, "bob/win_rate": 0.25, "compute_s/total": 2.0,
    }


# ---- SFT and eval ---------------------------------------------------------------------------------
def test_sft_and_eval_runs_log_the_same_way(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = [{"messages": [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i} w{i}"}]}
            for i in range(6)]
    result = tinkerless.sft(model=tiny_model, data=data, steps=3, batch_size=2, eval_every=1, storage=str(tmp_path),
                            run_id="s", progress=False, report_to=["tensorboard"])
    events = tensorboard_scalars(result.run_dir / "tensorboard")
    assert [(s.step, s.value) for s in events.Scalars("train_nll")] == \
        [(r["step"], pytest.approx(r["train_nll"])) for r in result.metrics]
    assert events.Tags()["images"] == ["plot/metrics"]

    config = tinkerless.TrainConfig(model=tiny_model, reward=_reward, tasks=TASKS, group_size=2, max_tokens=4,
                                    storage=str(tmp_path), report_to=["tensorboard"])
    report = tinkerless.evaluate(config, checkpoint="s@latest")
    [log_dir] = glob.glob(str(tmp_path / "runs" / "eval-s-*" / "tensorboard"))
    events = tensorboard_scalars(Path(log_dir))
    assert [(s.step, s.value) for s in events.Scalars("eval_reward_mean")] == [(3, pytest.approx(report.mean))]
    assert [s.step for s in events.Scalars("eval_pass@1")] == [3]
    assert "transcripts/text_summary" in events.Tags()["tensors"]
