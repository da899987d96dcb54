"""SkyPilot task files for tinkerless, and the commands those tasks run.

- `task_config` / `build_task`: a `sky.Task` from a YAML in the checkout's `sky/`
  directory with the model, port, GPU, infra, Python version and API key filled in,
  so the YAML a user launches by hand and the one `backend="sky"` launches are the same;
  `also_models`: the extra base models the server holds beside the model (its `ALSO_MODELS`: a run's teacher
  of another base, each passed to `tinkerless serve --also-model`);
- `python -m tinkerless.cloud.sky_tasks train FILE --storage URL --run-id ID [flags]`:
  `tinkerless train`, plus `--resume` when the run already exists in storage. SkyPilot
  reruns the same command after a preemption, so a first start and every restart must
  be one re-runnable command (`tinkerless train --resume` refuses a run that does not exist);
- `python -m tinkerless.cloud.sky_tasks serve --idle-minutes N [tinkerless serve flags]`:
  `tinkerless serve`, stopped after N minutes without calls. A running job keeps a SkyPilot
  cluster busy, so without this its autostop would never fire and an idle GPU would bill on.

Nothing here imports SkyPilot until a task is built.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinkerless.errors import ConfigError, TinkerlessError

if TYPE_CHECKING:
    import sky

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # the checkout that gets synced as the task's workdir
SKY_DIR = SOURCE_ROOT / "sky"
KEY_ENV = "TINKERLESS_API_KEY"  # the secret the YAMLs declare and `tinkerless serve --api-key-env` reads
SERVER_JOB_PREFIX = "tinkerless-serve"  # the server YAMLs' task names start so; a live job of that name is a live server


def task_path(name: str = "train") -> Path:
    """`sky/<name>.yaml` of this checkout (ConfigError when tinkerless was installed without one)."""
    path = SKY_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: backend='sky' launches the task files in the `sky/` directory of a "
            "tinkerless checkout, and syncs that checkout to the cluster",
            hint="git clone the tinkerless repository and `pip install -e '.[sky]'` from it, or pass yaml='path/to/task.yaml'",
        )
    return path


def task_config(
    path: str | Path,
    *,
    envs: Mapping[str, str] | None = None,
    accelerators: str | None = None,
    port: int | None = None,
    infra: str | None = None,
    workdir: str | Path | None = None,
) -> dict[str, Any]:
    """The task YAML as plain data with overrides applied (the port goes to both `ports` and $PORT)."""
    import yaml  # PyYAML, a SkyPilot dependency

    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read task file {path}: {exc}", hint="pass the path of a SkyPilot task YAML") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a SkyPilot task (a YAML mapping)", hint="see sky/train.yaml")
    resources = config.setdefault("resources", {})
    merged_envs = {str(k): str(v) for k, v in (envs or {}).items()}
    if accelerators is not None:
        resources["accelerators"] = accelerators
    if infra is not None:
        resources["infra"] = infra
    if port is not None:
        resources["ports"] = int(port)
        merged_envs["PORT"] = str(int(port))
    config["workdir"] = str(workdir or SOURCE_ROOT)  # absolute: the YAML's "." means "run from the checkout"
    config["envs"] = {**(config.get("envs") or {}), **merged_envs}
    return config


def build_task(config: Mapping[str, Any], *, secrets: Mapping[str, str] | None = None) -> sky.Task:
    """A validated `sky.Task` (offline: SkyPilot checks the schema, contacts nothing)."""
    import sky

    return sky.Task.from_yaml_config(dict(config), secrets_overrides=list((secrets or {}).items()) or None)


def also_models(model: str, extra: Any = (), run_config: Any = None) -> str:
    """`ALSO_MODELS` for a server task: the extra models asked for, plus the run's teacher when it is another base
    model (the server must hold it: docs/distillation.md), space-separated, each once and none the model itself."""
    from tinkerless.sdk.checkpoints.checkpoint_ref import same_model
    from tinkerless.sdk.run.distillation import teacher_kind

    if isinstance(extra, str) or not isinstance(extra, (list, tuple)):
        raise ConfigError(f"also_models must be a list of model ids, got {extra!r}", hint="e.g. also_models=['smollm2']")
    wanted = list(extra)
    teacher = getattr(run_config, "teacher", None)
    if isinstance(teacher, str) and teacher_kind(teacher.strip()) == "model":
        wanted.append(teacher.strip())
    out: list[str] = []
    for spec in wanted:
        if not isinstance(spec, str) or not spec.strip() or any(c.isspace() for c in spec.strip()):
            raise ConfigError(f"also_models: {spec!r} is not a model id (one word, no spaces)",
                              hint="a Hugging Face id such as Qwen/Qwen2.5-1.5B-Instruct, or a path on the node")
        if not same_model(spec, model) and not any(same_model(spec, kept) for kept in out):
            out.append(spec.strip())
    return " ".join(out)


def train_or_resume(argv: list[str]) -> int:
    """Run `tinkerless train` on `argv`, resuming the run when storage already holds it."""
    from tinkerless.coordinator import state_key
    from tinkerless.coordinator.state import validate_run_id
    from tinkerless.sdk.cli.commands import main as cli_main
    from tinkerless.storage import ObjectStore

    parser = argparse.ArgumentParser(
        prog="python -m tinkerless.cloud.sky_tasks train",
        description="`tinkerless train` that starts the run the first time and resumes it on every rerun.",
    )
    parser.add_argument("file")
    parser.add_argument("--storage", required=True, help="where the run's state and checkpoints live (s3://bucket/prefix)")
    parser.add_argument("--run-id", required=True, help="the run's id; a managed job passes $SKYPILOT_TASK_ID")
    args, rest = parser.parse_known_args(argv)
    rest = [arg for arg in rest if arg != "--resume"]  # decided here, from what storage holds
    try:
        validate_run_id(args.run_id)
        exists = ObjectStore(args.storage).exists(state_key(args.run_id))
    except TinkerlessError as exc:
        print(f"tinkerless: error: {exc}", file=sys.stderr)
        return 2
    action = "exists: resuming from its latest checkpoint" if exists else "is new: starting it"
    print(f"tinkerless: run {args.run_id} in {args.storage} {action}", file=sys.stderr, flush=True)
    command = ["train", args.file, "--storage", args.storage, "--run-id", args.run_id, *rest]
    return cli_main(command + (["--resume"] if exists else []))


def serve_until_idle(argv: list[str]) -> int:
    """Run `tinkerless serve` on `argv`; stop it (exit 0) once it has answered no call for --idle-minutes."""
    parser = argparse.ArgumentParser(prog="python -m tinkerless.cloud.sky_tasks serve")
    parser.add_argument("--idle-minutes", type=float, default=0.0, help="0: never stop")
    args, serve_args = parser.parse_known_args(argv)
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--port", type=int, default=8000)
    probe.add_argument("--api-key-env")
    known, _ = probe.parse_known_args(serve_args)
    server = subprocess.Popen([sys.executable, "-m", "tinkerless.sdk.cli.commands", "serve", *serve_args])
    signal.signal(signal.SIGTERM, lambda *_: server.terminate())  # a cancel or teardown reaches the server too
    if args.idle_minutes <= 0:
        return _exit_code(server.wait())
    limit = args.idle_minutes * 60.0
    poll = min(60.0, limit / 4)
    key = os.environ.get(known.api_key_env or "", "")
    last_total, last_active = -1.0, time.monotonic()
    while True:
        try:
            return _exit_code(server.wait(timeout=poll))
        except subprocess.TimeoutExpired:
            pass
        activity = _activity(known.port, key)
        now = time.monotonic()
        if activity is None or activity[1] or activity[0] != last_total:  # starting, busy, or served calls: not idle
            last_total, last_active = (activity[0] if activity else last_total), now
        elif now - last_active >= limit:
            print(
                f"tinkerless: no calls for {args.idle_minutes:g} minutes: stopping the server, so that "
                "SkyPilot's autostop can end the cluster",
                file=sys.stderr,
                flush=True,
            )
            server.terminate()
            server.wait()
            return 0


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode  # killed by signal N: the shell's 128+N


def _activity(port: int, key: str) -> tuple[float, bool] | None:
    """(calls answered so far, busy now) from the server's /metrics; None while it does not answer."""
    import httpx

    try:
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    total, busy = 0.0, False
    for line in response.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("tinkerless_requests_total{"):
            total += float(value)
        elif name in ("tinkerless_in_flight", "tinkerless_queue_depth"):
            busy = busy or float(value) > 0
    return total, busy


_USAGE = (
    "usage: python -m tinkerless.cloud.sky_tasks train FILE --storage URL --run-id ID [tinkerless train flags]\n"
    "       python -m tinkerless.cloud.sky_tasks serve [--idle-minutes N] [tinkerless serve flags]"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train":
        return train_or_resume(argv[1:])
    if argv and argv[0] == "serve":
        return serve_until_idle(argv[1:])
    print(_USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
