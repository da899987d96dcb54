"""SkyPilot: the task YAMLs validate offline, `backend="sky"` launches/reuses/tears down through
SkyPilot's request interface (faked at that single boundary) against a REAL `tinkerless serve`,
and the managed job's run command resumes after its process is killed like a preempted node."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import write_resumable_example
import yaml

import tinkerless
from tinkerless.cloud import sky_backend
from tinkerless.cloud.sky_backend import make_sky_backend
from tinkerless.cloud.sky_tasks import (
    KEY_ENV,
    SKY_DIR,
    SOURCE_ROOT,
    build_task,
    task_config,
)
from tinkerless.errors import ConfigError, RemoteError
from tinkerless.sdk.backends.base import call
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire.codec import PYTHON_VERSION

YAMLS = sorted(SKY_DIR.glob("*.yaml"))
VENV = Path(sys.executable).parent.parent  # the venv whose python runs these tests


@pytest.fixture(scope="session")
def sky(tmp_path_factory) -> Iterator[Any]:
    """SkyPilot imported with HOME in a temp dir (~/.sky state stays out of the real home), and any
    attempt to start or reach its API server failing the test: everything here must be offline."""
    home = tmp_path_factory.mktemp("sky-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        import sky.server.common as server_common

        import sky

        def refuse(*_args, **_kwargs):
            raise AssertionError("the SkyPilot API server was contacted; these tests must stay offline")

        for name in ("_start_api_server", "make_authenticated_request", "check_server_healthy_or_start_fn"):
            patch.setattr(server_common, name, refuse)
        yield sky


@pytest.fixture()
def tl_home(tmp_path, monkeypatch) -> Path:
    """Where sky_backend keeps cluster keys, per test."""
    monkeypatch.setenv("TINKERLESS_HOME", str(tmp_path / "tl-home"))
    monkeypatch.delenv(KEY_ENV, raising=False)
    return tmp_path / "tl-home"


# ---- the task YAMLs --------------------------------------------------------------------------


def test_the_four_task_files_exist():
    assert {p.name for p in YAMLS} >= {"train.yaml", "managed-job.yaml", "serve.yaml", "onprem.yaml"}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_yaml_validates_offline(sky, path):
    task = sky.Task.from_yaml(str(path))
    assert task.run and task.setup and task.name
    assert "PYTHON_VERSION" in task.envs and "uv venv" in task.setup  # the node's Python is pinned
    assert task.workdir == "."  # the checkout is synced; its .gitignore keeps .venv behind
    raw = yaml.safe_load(path.read_text())
    if path.name != "managed-job.yaml":  # the servers: key from a secret, read from the environment
        assert raw["secrets"] == {KEY_ENV: None}
        assert "--api-key-env TINKERLESS_API_KEY" in task.run and "--host 0.0.0.0" in task.run
        assert {r.ports[0] for r in task.resources} == {"8000"} and raw["envs"]["PORT"] == "8000"


def test_managed_job_recovers_spot_preemptions_and_keys_checkpoints_by_task_id(sky):
    task = sky.Task.from_yaml(str(SKY_DIR / "managed-job.yaml"))
    assert all(r.use_spot for r in task.resources)
    recovery = yaml.safe_load((SKY_DIR / "managed-job.yaml").read_text())["resources"]["job_recovery"]
    assert recovery["strategy"] == "EAGER_NEXT_REGION" and recovery["max_restarts_on_errors"] >= 1
    assert all(r.job_recovery["strategy"] == "EAGER_NEXT_REGION" for r in task.resources)
    assert '--run-id "${RUN_ID:-$SKYPILOT_TASK_ID}"' in task.run
    assert "-m tinkerless.cloud.sky_tasks train" in task.run and '--storage "$STORAGE"' in task.run


def test_serve_yaml_has_a_readiness_probe_on_healthz(sky):
    task = sky.Task.from_yaml(str(SKY_DIR / "serve.yaml"))
    spec = task.service
    assert spec.readiness_path == "/healthz" and spec.initial_delay_seconds >= 600
    assert spec.min_replicas == 1 and spec.max_replicas == 1  # adapters live in one replica's memory


def test_onprem_yaml_targets_an_ssh_node_pool(sky):
    task = sky.Task.from_yaml(str(SKY_DIR / "onprem.yaml"))
    assert {str(r.cloud) for r in task.resources} == {"SSH"}
    assert "sky ssh up" in (SKY_DIR / "onprem.yaml").read_text()


def test_task_overrides_gpu_port_infra_and_secret(sky, tmp_path):
    config = task_config(
        SKY_DIR / "train.yaml", envs={"MODEL": "Qwen/Qwen2.5-0.5B-Instruct"}, accelerators="H100:1", port=9001, infra="aws"
    )
    task = build_task(config, secrets={KEY_ENV: "tml-test-secret"})
    (resources,) = task.resources
    assert resources.accelerators == {"H100": 1} and resources.ports == ["9001"] and str(resources.cloud) == "AWS"
    assert task.envs["PORT"] == "9001" and task.envs["MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert task.workdir == str(SOURCE_ROOT)
    assert task.secrets[KEY_ENV].get_secret_value() == "tml-test-secret"
    assert "tml-test-secret" not in json.dumps(task.envs) and "tml-test-secret" not in repr(task)


# ---- backend="sky": SkyPilot's request interface faked, the server real ------------------------


class FakeSky:
    """SkyPilot's SDK at its request boundary: each call records itself and returns a request id
    that get/stream_and_get resolve (or raise on), as the real client-server SDK does."""

    def __init__(self, sky: Any, monkeypatch: pytest.MonkeyPatch, *, endpoint: str, up: tuple[str, ...] = ()):
        self.sky = sky
        self.endpoint = endpoint
        self.clusters = {name: sky.ClusterStatus.UP for name in up}
        self.jobs: dict[str, list[tuple[str, Any]]] = {name: [("tinkerless-serve", self._running())] for name in up}
        self.calls: list[tuple[str, tuple, dict]] = []
        self.on_launch: Callable[[Any], None] = lambda task: None
        self.on_down: Callable[[str], None] = lambda name: None
        self.launch_error: Exception | None = None
        self._results: dict[str, tuple[bool, Any]] = {}
        self._ids = count()
        self.enabled = ["aws"]  # the clouds SkyPilot's last `sky check` enabled
        for name in ("launch", "status", "queue", "endpoints", "down", "get", "stream_and_get"):
            monkeypatch.setattr(sky, name, getattr(self, name))
        monkeypatch.setattr(sky, "enabled_clouds", self.enabled_clouds, raising=False)  # real one: sky.client.sdk

    @staticmethod
    def _running() -> Any:
        from sky.skylet.job_lib import JobStatus

        return JobStatus.RUNNING

    def _request(self, kind: str, result: Any = None, error: Exception | None = None) -> str:
        request_id = f"{kind}-{next(self._ids)}"
        self._results[request_id] = (error is None, error if error is not None else result)
        return request_id

    def names(self) -> list[str]:
        return [name for name, _, _ in self.calls if name not in ("get", "stream_and_get")]

    def launch(self, task, cluster_name=None, **kwargs):
        self.calls.append(("launch", (task,), {"cluster_name": cluster_name, **kwargs}))
        if self.launch_error is not None:
            return self._request("launch", error=self.launch_error)
        self.on_launch(task)
        self.clusters[cluster_name] = self.sky.ClusterStatus.UP
        self.jobs.setdefault(cluster_name, []).append((task.name, self._running()))
        return self._request("launch", (len(self.jobs[cluster_name]), None))

    def status(self, cluster_names=None, **kwargs):
        from sky.schemas.api.responses import StatusResponse

        self.calls.append(("status", (cluster_names,), kwargs))
        records = [
            StatusResponse(
                name=name, launched_at=0, status=status, autostop=-1, to_down=False, cluster_hash="h",
                cluster_ever_up=True, user_hash="u", user_name="me", workspace="default", is_managed=False, nodes=1,
            )
            for name, status in self.clusters.items()
            if cluster_names is None or name in cluster_names
        ]
        return self._request("status", records)

    def queue(self, cluster_name, skip_finished=False, all_users=False):
        from sky.schemas.api.responses import ClusterJobRecord

        self.calls.append(("queue", (cluster_name,), {"skip_finished": skip_finished}))
        records = [
            ClusterJobRecord(
                job_id=i + 1, job_name=name, username="me", user_hash="u", submitted_at=0.0, resources="1x[L4:1]",
                status=status, log_path="~/sky_logs",
            )
            for i, (name, status) in enumerate(self.jobs.get(cluster_name, []))
            if not (skip_finished and status.is_terminal())
        ]
        return self._request("queue", records)

    def enabled_clouds(self, workspace=None, expand=False):
        self.calls.append(("enabled_clouds", (), {}))
        return self._request("enabled_clouds", list(self.enabled))

    def endpoints(self, cluster, port=None):
        self.calls.append(("endpoints", (cluster, port), {}))
        if cluster not in self.clusters:
            return self._request("endpoints", error=ValueError(f"cluster {cluster} is not UP"))
        return self._request("endpoints", {port: self.endpoint})

    def down(self, cluster_name, **kwargs):
        self.calls.append(("down", (cluster_name,), kwargs))
        self.jobs.pop(cluster_name, None)
        if self.clusters.pop(cluster_name, None) is None:
            return self._request("down", error=self.sky.exceptions.ClusterDoesNotExist(cluster_name))
        self.on_down(cluster_name)
        return self._request("down", None)

    def get(self, request_id, **_kwargs):
        self.calls.append(("get", (request_id,), {}))
        ok, value = self._results.pop(request_id)
        if not ok:
            raise value
        return value

    stream_and_get = get


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server(worker, tmp_path: Path, key: str):
    return serve_in_thread(create_app(worker, keys=KeyStore(ObjectStore(str(tmp_path / "server")), extra_keys={key: "default"})))


@tinkerless.reward
def short_reward(completion, task):
    return float(len(completion) % 3)


def test_launch_runs_the_yaml_server_then_trains_and_tears_down(sky, tl_home, tiny_model, tmp_path, monkeypatch, caplog, capfd):
    """No cluster yet: launch. The fake launch runs the task's own `run` command with the task's envs
    and secrets, as the node would, so the server that answers is the one the YAML starts."""
    caplog.set_level(logging.DEBUG)
    port = _free_port()
    fake = FakeSky(sky, monkeypatch, endpoint=f"127.0.0.1:{port}")
    node_home = tmp_path / "node-home"
    node_home.mkdir()
    (node_home / "tinkerless-venv").symlink_to(VENV)  # what the YAML's setup builds
    server_log = tmp_path / "server.log"
    processes: list[subprocess.Popen] = []

    def run_on_node(task) -> None:
        env = {**os.environ, **task.envs, "HOME": str(node_home)}
        env.update({k: v.get_secret_value() for k, v in task.secrets.items()})
        with server_log.open("w") as log:
            processes.append(
                subprocess.Popen(["bash", "-c", task.run], cwd=task.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
            )

    def stop_node(_name: str) -> None:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)

    fake.on_launch, fake.on_down = run_on_node, stop_node
    try:
        backend = make_sky_backend(
            tiny_model, cluster="tl-test", down_on_close=True, port=port, health_timeout=180, poll_interval=0.2,
            engine="auto", micro_batch_size=16,  # what make_backend passes; the server owns them
        )
        assert fake.names() == ["status", "enabled_clouds", "launch", "endpoints"]
        (task,), launch_kwargs = next((args, kwargs) for name, args, kwargs in fake.calls if name == "launch")
        assert launch_kwargs["cluster_name"] == "tl-test" and launch_kwargs["idle_minutes_to_autostop"] == 10
        assert launch_kwargs["down"] is True and task.envs["IDLE_MINUTES"] == "60"
        key = task.secrets[KEY_ENV].get_secret_value()
        assert key.startswith("tml-") and KEY_ENV not in task.envs
        assert task.envs["MODEL"] == tiny_model and task.envs["PYTHON_VERSION"] == PYTHON_VERSION
        assert task.envs["PORT"] == str(port) and [r.ports for r in task.resources] == [[str(port)]] * len(task.resources)
        key_file = sky_backend.key_file("tl-test")
        assert key_file.read_text() == key and key_file.stat().st_mode & 0o077 == 0

        assert call(backend, "info", {})["model"] == tiny_model
        result = tinkerless.train(
            model=tiny_model, reward=short_reward, tasks=[{"prompt": "2+3?"}, {"prompt": "1+1?"}], steps=2,
            batch_size=2, group_size=2, max_tokens=4, storage=str(tmp_path / "runs"), progress=False, backend=backend,
        )
        assert len(result.metrics) == 2 and result.last_checkpoint_step == 2
        assert backend.usage.calls()["rollout"] == 2 and backend.usage.seconds()["rollout"] > 0
        # train() closed the backend: down_on_close tore the cluster down and forgot its key
        assert fake.names()[-1] == "down" and "tl-test" not in fake.clusters and not key_file.exists()
        assert all(p.poll() is not None for p in processes)
        with pytest.raises(httpx.ConnectError):  # the teardown reached the server itself, not just its wrapper
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        stop_node("tl-test")
    out, err = capfd.readouterr()
    logged = caplog.text + out + err + server_log.read_text()
    assert "launching SkyPilot cluster tl-test" in caplog.text
    assert f"Uvicorn running on http://0.0.0.0:{port}" in server_log.read_text()  # the YAML's command served
    assert key not in logged, "the API key leaked into a log"


def test_reuses_an_up_cluster_without_launching(sky, tl_home, worker, tmp_path, monkeypatch):
    key = sky_backend.new_api_key()
    with _server(worker, tmp_path, key) as url:
        fake = FakeSky(sky, monkeypatch, endpoint=url.removeprefix("http://"), up=("tl-up",))
        sky_backend.save_key("tl-up", key)  # what an earlier launch from this machine left
        backend = make_sky_backend(worker.model_name, cluster="tl-up", poll_interval=0.1)
        assert fake.names() == ["status", "queue", "endpoints"], "a cluster with a live server is not launched again"
        assert call(backend, "info", {})["model"] == worker.model_name
        assert backend.usage.calls() == {"info": 1}
        backend.close()  # not asked to tear down: the cluster stays
        assert "down" not in fake.names() and "tl-up" in fake.clusters

        # A stale saved key (from an earlier cluster of that name) and the key a user launched
        # this one with by hand, in the environment: the one the server accepts is used.
        sky_backend.save_key("tl-up", sky_backend.new_api_key())
        monkeypatch.setenv(KEY_ENV, key)
        again = make_sky_backend(worker.model_name, cluster="tl-up", poll_interval=0.1)
        assert call(again, "info", {})["model"] == worker.model_name
        again.down()  # explicit teardown
        assert fake.names()[-1] == "down" and "tl-up" not in fake.clusters
        sky_backend.down("tl-up")  # already gone: not an error


def test_an_up_cluster_whose_server_stopped_gets_it_started_again(sky, tl_home, worker, tmp_path, monkeypatch):
    key = sky_backend.new_api_key()
    with _server(worker, tmp_path, key) as url:
        fake = FakeSky(sky, monkeypatch, endpoint=url.removeprefix("http://"), up=("tl-idle",))
        from sky.skylet.job_lib import JobStatus

        fake.jobs["tl-idle"] = [("tinkerless-serve", JobStatus.SUCCEEDED)]  # it stopped itself when idle
        backend = make_sky_backend(worker.model_name, cluster="tl-idle", api_key=key, poll_interval=0.1)
        assert fake.names() == ["status", "queue", "enabled_clouds", "launch", "endpoints"]
        launch = next(kwargs for name, _, kwargs in fake.calls if name == "launch")
        assert launch["cluster_name"] == "tl-idle"  # onto the same cluster: SkyPilot reuses it
        assert call(backend, "info", {})["model"] == worker.model_name


def test_reuse_refuses_a_wrong_key_a_missing_key_and_another_model(sky, tl_home, worker, tmp_path, monkeypatch):
    key = sky_backend.new_api_key()
    with _server(worker, tmp_path, key) as url:
        FakeSky(sky, monkeypatch, endpoint=url.removeprefix("http://"), up=("tl-up",))
        with pytest.raises(ConfigError, match="no API key") as missing:
            make_sky_backend(worker.model_name, cluster="tl-up")
        assert "sky down tl-up" in missing.value.hint
        with pytest.raises(ConfigError, match="does not accept this API key"):
            make_sky_backend(worker.model_name, cluster="tl-up", api_key="tml-0000-wrong", poll_interval=0.1)
        with pytest.raises(ConfigError, match="serves model") as other:
            make_sky_backend("some/other-model", cluster="tl-up", api_key=key, poll_interval=0.1)
        assert "cluster=" in other.value.hint


def test_health_timeout_names_the_url_and_the_log_command(sky, tl_home, monkeypatch):
    port = _free_port()  # nothing listens there: a server that never came up
    fake = FakeSky(sky, monkeypatch, endpoint=f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(RemoteError) as error:
        make_sky_backend("smollm2", cluster="tl-dead", health_timeout=1.0, poll_interval=0.2)
    assert time.monotonic() - started < 15
    assert f"http://127.0.0.1:{port}" in str(error.value) and "did not become healthy within 1s" in str(error.value)
    assert "sky logs tl-dead" in error.value.hint and "sky down tl-dead" in error.value.hint
    assert fake.names() == ["status", "enabled_clouds", "launch", "endpoints"]


def test_no_cloud_and_launch_failures_point_to_sky_check(sky, tl_home, monkeypatch):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    fake.launch_error = sky.exceptions.NoCloudAccessError("Cloud access is not set up. Run: sky check")
    with pytest.raises(ConfigError, match="SkyPilot can reach no cloud") as no_cloud:
        make_sky_backend("smollm2", gpu="H100:1")
    assert "sky check" in no_cloud.value.hint
    fake.launch_error = sky.exceptions.ResourcesUnavailableError("no H100 anywhere")
    with pytest.raises(RemoteError, match="sky launch of cluster tinkerless-smollm2 failed") as unavailable:
        make_sky_backend("smollm2", gpu="H100:1")
    assert "sky check" in unavailable.value.hint and "sky logs --provision tinkerless-smollm2" in unavailable.value.hint


def test_missing_skypilot_and_bad_options_are_config_errors(tl_home, monkeypatch):
    monkeypatch.setitem(sys.modules, "sky", None)  # as if skypilot were not installed
    with pytest.raises(ConfigError) as missing:
        make_sky_backend("smollm2")
    assert missing.value.hint == "pip install 'tinkerless[sky]'"
    with pytest.raises(ConfigError, match="unknown option") as unknown:
        make_sky_backend("smollm2", health_timout=5)
    assert "health_timeout" in unknown.value.hint
    assert sky_backend.default_cluster_name("HuggingFaceTB/SmolLM2-135M-Instruct") == "tinkerless-smollm2-135m-instruct"
    with pytest.raises(ConfigError, match="invalid SkyPilot cluster name"):
        make_sky_backend("smollm2", cluster="../escape")


def test_import_tinkerless_and_the_sky_modules_does_not_import_skypilot():
    code = "import sys, tinkerless, tinkerless.cloud.sky_backend, tinkerless.cloud.sky_tasks; print('sky' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_server_stops_itself_after_idle_minutes_so_autostop_can_fire(tiny_model, tmp_path):
    """The server YAMLs' run command: `tinkerless serve` that exits 0 once no call came for --idle-minutes."""
    port, key = _free_port(), sky_backend.new_api_key()
    command = [
        sys.executable, "-m", "tinkerless.cloud.sky_tasks", "serve", "--idle-minutes", "0.05",  # 3 s
        "--host", "127.0.0.1", "--port", str(port), "--model", tiny_model, "--storage", str(tmp_path / "server"),
        "--api-key-env", KEY_ENV,
    ]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(command, env={**os.environ, KEY_ENV: key}, stdout=out, stderr=subprocess.STDOUT)
    try:
        sky_backend.wait_healthy(f"http://127.0.0.1:{port}", cluster="local", timeout=120, interval=0.2)
        from tinkerless.sdk.backends.http import HTTPBackend

        assert call(HTTPBackend(f"http://127.0.0.1:{port}", api_key=key), "info", {})["model"] == tiny_model
        last_call = time.monotonic()
        assert server.wait(timeout=90) == 0, log.read_text()
        assert time.monotonic() - last_call >= 3.0, "stopped before it had been idle for --idle-minutes"
    finally:
        server.kill()
    assert "no calls for 0.05 minutes: stopping the server" in log.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)


# ---- resume after preemption, for real ----------------------------------------------------------

STEPS = 8


@pytest.fixture()
def resumable(tmp_path, tiny_model) -> Path:
    return write_resumable_example(tmp_path / "resumable.py", tiny_model, STEPS)


TASK_ID = "sky-managed-2026-01-01-00-00-00-000001_tl-arith_1-0"  # SkyPilot's format; the same after a recovery


class ManagedJobNode:
    """Runs managed-job.yaml's `run` verbatim, as a fresh node would: bash, the YAML's envs, the venv
    its setup builds (here, this one), SKYPILOT_TASK_ID; in its own process group, killed whole."""

    def __init__(self, tmp_path: Path, **envs: str):
        self.spec = yaml.safe_load((SKY_DIR / "managed-job.yaml").read_text())
        self.tmp_path = tmp_path
        home = tmp_path / "node-home"
        home.mkdir(exist_ok=True)
        if not (home / "tinkerless-venv").exists():
            (home / "tinkerless-venv").symlink_to(VENV)
        yaml_envs = {k: str(v) for k, v in self.spec["envs"].items()}
        self.env = {**os.environ, **yaml_envs, "HOME": str(home), "SKYPILOT_TASK_ID": TASK_ID, "OMP_NUM_THREADS": "1", **envs}

    def start(self, name: str) -> subprocess.Popen:
        with (self.tmp_path / f"{name}.log").open("w") as out:
            return subprocess.Popen(
                ["bash", "-c", self.spec["run"]], cwd=self.tmp_path, env=self.env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def run(self, name: str, timeout: float = 600) -> str:
        process = self.start(name)
        log = self.tmp_path / f"{name}.log"
        assert process.wait(timeout=timeout) == 0, log.read_text()
        return log.read_text()


def test_managed_job_run_command_resumes_after_a_kill(tmp_path, resumable):
    """The managed job's `run` on local storage: SIGKILL the whole process group after a
    checkpoint (a preempted node), run the identical command again, and it continues from `latest`."""
    storage = tmp_path / "bucket"
    node = ManagedJobNode(tmp_path, STORAGE=str(storage), TRAIN_FILE=str(resumable))
    run_dir = storage / "runs" / TASK_ID

    def latest_step() -> int:
        try:
            return json.loads((run_dir / "checkpoints" / "latest").read_text())["step"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return 0

    def metrics_lines() -> list[str]:
        try:
            return (run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []

    first = node.start("first")
    deadline = time.monotonic() + 300
    # Kill inside the step after a checkpoint whose metrics line is written too: the trainer moves
    # `latest` a moment before it logs that step's metrics line, and a kill in between loses the line.
    while not (latest_step() >= 2 and len(metrics_lines()) >= latest_step()) and first.poll() is None:
        assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.02)
    assert first.poll() is None, "the run ended before it could be killed:\n" + (tmp_path / "first.log").read_text()
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed_at = latest_step()
    assert 2 <= killed_at < STEPS
    assert f"run {TASK_ID} in {storage} is new: starting it" in (tmp_path / "first.log").read_text()

    log = node.run("second")
    assert "exists: resuming from its latest checkpoint" in log
    assert f"resumed from checkpoint step-{killed_at}" in log  # continued, not restarted
    assert latest_step() == STEPS
    assert [json.loads(line)["step"] for line in metrics_lines()] == list(range(STEPS))

    # A recovery that lands after the run finished reruns the command once more: a no-op success.
    node.run("third", timeout=300)
    assert latest_step() == STEPS and len(metrics_lines()) == STEPS


def test_managed_job_run_command_keeps_the_run_in_an_s3_bucket(tmp_path, resumable, monkeypatch):
    """The same command with s3:// storage (moto's S3 API on 127.0.0.1): the first start creates the
    run in the bucket under SKYPILOT_TASK_ID, and a rerun resumes it from the bucket's `latest`."""
    from s3_server import TEST_ENV, MotoS3

    from tinkerless.coordinator import checkpoint_prefix
    from tinkerless.storage import CheckpointStore

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):  # nothing from the real AWS setup
        monkeypatch.delenv(name, raising=False)
    moto = MotoS3().start()
    try:
        aws = {
            **TEST_ENV, "AWS_ENDPOINT_URL": moto.endpoint,
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        }
        storage = f"s3://{moto.create_bucket()}/tinkerless"
        node = ManagedJobNode(tmp_path, STORAGE=storage, TRAIN_FILE=str(resumable), TRAIN_ARGS="--steps 2", **aws)
        assert f"run {TASK_ID} in {storage} is new: starting it" in node.run("first")
        node.env["TRAIN_ARGS"] = "--steps 3"  # the same run, continued further
        log = node.run("second")
        assert "exists: resuming from its latest checkpoint" in log and "resumed from checkpoint step-2" in log
        for name, value in aws.items():
            monkeypatch.setenv(name, value)
        assert CheckpointStore(ObjectStore(storage), checkpoint_prefix(TASK_ID)).latest_step() == 3
    finally:
        moto.stop()


def test_a_launch_for_a_run_prints_its_estimate_on_every_gpu_it_accepts_before_spending(sky, tl_home, monkeypatch, capsys):
    fake = FakeSky(sky, monkeypatch, endpoint="127.0.0.1:1")
    printed_before_launch: list[str] = []
    fake.on_launch = lambda task: printed_before_launch.append(capsys.readouterr().out)
    fake.launch_error = sky.exceptions.ResourcesUnavailableError("nothing free")  # stop there: nothing is spent
    config = tinkerless.TrainConfig(model="smollm2", reward=short_reward, tasks=[{"prompt": "2+3?"}], steps=20,
                                    batch_size=8, group_size=4, max_tokens=12, name="sums")
    with pytest.raises(RemoteError):  # the YAML's list of GPUs: SkyPilot may launch any, so each is estimated
        make_sky_backend("smollm2", cluster="tl-est", run_config=config)
    out = capsys.readouterr().out
    assert "launching SkyPilot cluster tl-est for run 'sums'" in out and "estimate for 20 steps" in out
    rows = {line.split()[0] for line in out.splitlines()[3:] if line.startswith("  ")}
    assert rows == {"L4", "A10G", "L40S", "A100-40GB", "H100"}
    fake.launch_error = None
    with pytest.raises(Exception):  # the one GPU asked for; printed before the launch call (which fails later here)
        make_sky_backend("smollm2", cluster="tl-est2", gpu="H100:1", run_config=config, health_timeout=0.2, poll_interval=0.1)
    assert printed_before_launch and "H100" in printed_before_launch[-1] and "A10G" not in printed_before_launch[-1]
    # A launch for no run (`make_sky_backend` alone: a server for whoever connects) has no run to estimate.
    fake.launch_error = sky.exceptions.ResourcesUnavailableError("nothing free")
    with pytest.raises(RemoteError):
        make_sky_backend("smollm2", cluster="tl-est3")
    assert "estimate for" not in capsys.readouterr().out


# ---- extra base models on the cluster's server (a run's teacher of another base) ----------------


@pytest.mark.parametrize("name", ["train.yaml", "onprem.yaml", "serve.yaml"])
def test_the_server_yamls_pass_each_extra_model_to_serve_as_also_model(sky, name, tmp_path):
    """The YAML's own run command, run by bash as the node runs it, with the venv's entry points standing in for
    the server: ALSO_MODELS becomes one `--also-model ID` per id (none by default, no glob, no empty id)."""
    assert sky.Task.from_yaml(str(SKY_DIR / name)).envs["ALSO_MODELS"] == ""
    node_home = tmp_path / "node-home"
    argv_file = tmp_path / "argv"
    (node_home / "tinkerless-venv/bin").mkdir(parents=True)
    for tool in ("python", "tinkerless"):  # what the setup installs; here they write down how they were called
        script = node_home / "tinkerless-venv/bin" / tool
        script.write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {argv_file}\n')
        script.chmod(0o755)
    (tmp_path / "star-matches-this").touch()
    for value, expected in (("", []), ("org/m1", ["org/m1"]), ("  org/m1   /srv/m2 ", ["org/m1", "/srv/m2"]),
                            ("*", ["*"])):
        task = build_task(task_config(SKY_DIR / name, envs={"ALSO_MODELS": value}, workdir=tmp_path),
                          secrets={KEY_ENV: "tml-x"})
        env = {"PATH": os.environ["PATH"], **task.envs, "HOME": str(node_home), KEY_ENV: "tml-x"}
        subprocess.run(["bash", "-c", task.run], cwd=tmp_path, env=env, check=True, timeout=30)
        argv = argv_file.read_text().splitlines()
        extras = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--also-model"]
        assert extras == expected, (value, argv)
        assert argv[argv.index("--model") + 1] == task.envs["MODEL"]


def test_a_launch_for_a_run_with_a_teacher_of_another_base_serves_it_and_distills_from_it(
        sky, tl_home, tiny_model, tmp_path, monkeypatch):
    """backend="sky" for a run whose teacher is another base model: the launched YAML's server holds it beside the
    student's base (--also-model), and the run distills from it there."""
    from tinkerless.cloud.sky_tasks import also_models
    from tinkerless.functions.models import build_tiny_model

    teacher = build_tiny_model(tmp_path / "teacher", hidden_size=64, num_layers=2, seed=1, initializer_range=0.2)
    assert also_models(tiny_model, [], tinkerless.TrainConfig(model=tiny_model, teacher=tiny_model)) == ""
    assert also_models(tiny_model, ["a/b", "a/b"], tinkerless.TrainConfig(model=tiny_model, teacher="run@3")) == "a/b"
    for bad in ("a b", ["a b"], [""], [3]):
        with pytest.raises(ConfigError):
            also_models(tiny_model, bad)
    port = _free_port()
    fake = FakeSky(sky, monkeypatch, endpoint=f"127.0.0.1:{port}")
    node_home = tmp_path / "node-home"
    node_home.mkdir()
    (node_home / "tinkerless-venv").symlink_to(VENV)
    processes: list[subprocess.Popen] = []
    log = (tmp_path / "server.log").open("w")

    def run_on_node(task) -> None:
        env = {**os.environ, **task.envs, "HOME": str(node_home), KEY_ENV: task.secrets[KEY_ENV].get_secret_value()}
        processes.append(subprocess.Popen(["bash", "-c", task.run], cwd=task.workdir, env=env, stdout=log,
                                          stderr=subprocess.STDOUT))

    fake.on_launch = run_on_node
    config = tinkerless.TrainConfig(model=tiny_model, teacher=teacher, tasks=[{"prompt": "2+3?"}], steps=1,
                                    batch_size=2, group_size=2, max_tokens=4, progress=False, name="opd")
    try:
        backend = make_sky_backend(tiny_model, cluster="tl-opd", down_on_close=True, port=port, health_timeout=180,
                                   poll_interval=0.2, run_config=config)
        (task,), _ = next((args, kwargs) for name, args, kwargs in fake.calls if name == "launch")
        assert task.envs["ALSO_MODELS"] == teacher
        result = tinkerless.train(config, backend=backend, storage=str(tmp_path / "runs"))
        record = result.metrics[0]
        assert record["teacher_aligned_share"] == 1.0 and abs(record["teacher_logprob_gap"]) > 1e-3
        assert result.usage["compute_seconds"]["teacher"] > 0
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        log.close()
