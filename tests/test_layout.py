"""The rooms of the code (docs/architecture.md), and what was persisted before they were split still loads.

- Floors: no package imports one above it (errors < storage < wire < coordinator < envs < functions < server
  < sdk < cloud), and importing the client never imports the cloud package.
- Every package states its job in its docstring; no module is over 450 lines.
- Old module paths (users' imports, pickles of their code) are the new modules.
- `tests/fixtures/pre_split/`, written by the code before the split (`make_pre_split_fixture.py`): a local
  run resumes from its checkpoint, a server's keys, hosted run and Tinker checkpoint serve, old pickles load.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import cloudpickle
import httpx
import pytest

import tinkerless

PACKAGE = Path(tinkerless.__file__).parent
FIXTURE = Path(__file__).parent / "fixtures" / "pre_split"
FLOORS = ["errors", "storage", "wire", "coordinator", "envs", "functions", "server", "sdk", "cloud"]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out


def _floor(module: str) -> str | None:
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else None
    return name if name in FLOORS else None


def test_no_package_imports_one_on_a_higher_floor():
    upward = []
    for module, path in _modules():
        here = _floor(module)
        if here is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for name in names:
                there = _floor(name) if name.startswith("tinkerless.") else None
                if there is not None and FLOORS.index(there) > FLOORS.index(here):
                    upward.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}")
    assert not upward, "\n".join(upward)


def test_importing_the_client_never_imports_the_cloud_package():
    code = ("import sys, tinkerless, tinkerless.sdk, tinkerless.sdk.run.trainer, tinkerless.sdk.backends.base; "
            "print([m for m in sys.modules if m.startswith('tinkerless.cloud')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_package_states_its_job_and_no_module_is_over_450_lines():
    for module, path in _modules():
        if path.name == "__init__.py":
            assert ast.get_docstring(ast.parse(path.read_text())), f"{module} has no docstring saying what it holds"
        lines = len(path.read_text().splitlines())
        assert lines <= 450, f"{path.relative_to(PACKAGE.parent)} has {lines} lines"


def test_old_module_paths_are_the_new_modules():
    import importlib

    from tinkerless._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from tinkerless.sdk.trainer import train  # an old import, as users wrote it

    assert train is tinkerless.train


def test_pickles_made_before_the_split_load():
    loaded = cloudpickle.loads((FIXTURE / "pickled.bin").read_bytes())
    from tinkerless.envs.decorators import AgentResult
    from tinkerless.functions.sampling.engine import row_seed
    from tinkerless.sdk.run.agents import self_play

    assert loaded["self_play"] is self_play and loaded["row_seed"] is row_seed and loaded["AgentResult"] is AgentResult


def test_a_run_written_before_the_split_resumes_from_its_checkpoint(tmp_path):
    storage = tmp_path / "local"
    shutil.copytree(FIXTURE / "local", storage)
    from tinkerless.sdk.run.metrics import read_metrics

    before = read_metrics(storage / "runs" / "pre-split" / "metrics.jsonl")
    assert [r["step"] for r in before] == [0, 1] and before[-1]["compute_s/total"] > 0  # gpu_s/* then
    result = tinkerless.train(model="tiny", reward=lambda c, t: float(len(c) % 3 == 0),
                              tasks=[{"prompt": "hi"}, {"prompt": "ho"}], steps=3, batch_size=2, group_size=2,
                              max_tokens=4, progress=False, checkpoint_every=1, seed=3, storage=str(storage),
                              run_id="pre-split", resume=True)
    after = read_metrics(storage / "runs" / "pre-split" / "metrics.jsonl")
    assert [r["step"] for r in after] == [0, 1, 2]  # resumed at step 2, from the checkpoint written before
    assert result.usage["compute_seconds_total"] > before[-1]["compute_s/total"]  # earlier seconds carried over
    assert (storage / "runs" / "pre-split" / "checkpoints" / "step-3" / "manifest.json").exists()


def test_a_server_storage_from_before_the_split_serves_its_keys_runs_and_tinker_checkpoints(tmp_path):
    from tinkerless.functions.worker import Worker
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.sdk.backends.server_runs import ServerRunHost
    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore

    server = tmp_path / "server"
    shutil.copytree(FIXTURE / "server", server)
    saved = json.loads((FIXTURE / "keys.json").read_text())
    keys = KeyStore(ObjectStore(str(server)))
    assert keys.tenant_for(saved["alice"]) == "alice"
    with serve_in_thread(create_app(Worker("tiny"), keys=keys, storage=str(server))) as url:
        runs = ServerRunHost(HTTPBackend(url, api_key=saved["alice"])).list()
        assert [r.run_id for r in runs] == ["hosted"] and runs[0].last_checkpoint_step == 2
        tinkerless.train(model="tiny", reward=lambda c, t: 1.0, tasks=[{"prompt": "hi"}, {"prompt": "ho"}], steps=3,
                         batch_size=2, group_size=2, max_tokens=4, progress=False, checkpoint_every=1, seed=3,
                         storage=str(tmp_path / "client"), run_id="hosted", resume=True,
                         backend=HTTPBackend(url, api_key=saved["alice"]))
        assert (server / "tenants" / "alice" / "runs" / "hosted" / "checkpoints" / "step-3").is_dir()
        auth = {"Authorization": f"Bearer {saved['alice']}"}
        listed = httpx.get(f"{url}/api/v1/training_runs/{saved['model_id']}/checkpoints", headers=auth).json()
        assert [c["tinker_path"] for c in listed["checkpoints"]] == [saved["tinker_path"]]
        chat = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
            "model": "hosted@latest", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200, chat.text  # the hosted run's checkpoint, served as an adapter


@pytest.mark.parametrize("command", [["-m", "tinkerless.sdk.cli", "--help"], ["-m", "tinkerless.sdk.cli.commands", "--help"]])
def test_the_cli_module_paths_still_run(command):
    out = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train" in out.stdout
