"""Run Python in a `modal.Sandbox` (gVisor: a kernel of its own), for workers that run on Modal.

Modal containers cannot start bubblewrap, so a Modal worker (its image sets
TINKERLESS_SANDBOX=modal) creates one Sandbox per tool call with the same limits:

- `block_network=True` unless `SandboxLimits.network` asks for it;
- `timeout` (Modal kills the sandbox) a little past `wall_seconds`, and the worker
  terminates it at `wall_seconds` itself;
- `memory` (MiB) covering `memory_bytes` per allowed process and `cpu=1`;
- an image holding only Debian and this Python version (no site-packages of ours);
- inside, the same bootstrap as under bubblewrap: it drops root to uid 65534, sets
  RLIMIT_CPU/AS/FSIZE/NOFILE/NPROC and runs the audit-hook layer, so every limit and
  every `reason` means the same as locally. Not capped here: the total size of what
  the program writes (Modal gives each sandbox its own ephemeral disk).

The program travels on stdin, after one line with its length, ahead of the program's
own input, so no file has to be uploaded.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import Any

from tinkerless.envs.sandbox.bootstrap import BOOTSTRAP
from tinkerless.envs.sandbox.limits import SandboxLimits, SandboxResult, SandboxUnavailable, reason_for, rlimit_values
from tinkerless.envs.sandbox.supervise import Capture

APP_NAME = "tinkerless-sandboxes"
NOBODY = 65534
POLL_SECONDS = 0.05
TIMEOUT_MARGIN_SECONDS = 5  # Modal's own timeout is a backstop behind the worker's
HINT = "run this on a Modal worker with Modal credentials (modal token new), or use sandbox='bwrap' elsewhere; see docs/sandbox.md"


def _import_modal() -> Any:
    try:
        import modal
    except ImportError as exc:
        raise SandboxUnavailable("sandbox='modal' needs the modal package", hint="pip install 'tinkerless[modal]'") from exc
    return modal


@functools.lru_cache(maxsize=1)
def _app_and_image() -> tuple[Any, Any]:
    modal = _import_modal()
    image = modal.Image.debian_slim(python_version=f"{sys.version_info.major}.{sys.version_info.minor}")
    try:
        app = modal.App.lookup(APP_NAME, create_if_missing=True)
    except Exception as exc:  # no token, no network: the sandbox cannot exist, and must not be faked
        raise SandboxUnavailable(f"cannot reach Modal to create a sandbox: {type(exc).__name__}: {exc}", hint=HINT) from exc
    return app, image


def sandbox_options(limits: SandboxLimits) -> dict[str, Any]:
    """The `modal.Sandbox.create` keyword arguments for `limits` (besides app and image)."""
    per_process_mib = math.ceil(limits.memory_bytes / 2**20)
    return {
        "timeout": math.ceil(limits.wall_seconds) + TIMEOUT_MARGIN_SECONDS,
        "cpu": 1.0,
        "memory": per_process_mib * (1 + limits.max_processes) + 128,  # + the interpreter's own start-up
        "block_network": not limits.network,
        "workdir": "/tmp",
    }


def run_modal(code: str, *, limits: SandboxLimits, stdin: str, config: dict) -> SandboxResult:
    modal = _import_modal()
    app, image = _app_and_image()
    config = {
        **config,
        "work": "/tmp",
        "code": None,  # on stdin
        "read_roots": None,  # the image's own standard library, found inside
        "drop_to": [NOBODY, NOBODY],
        "nproc": limits.max_processes,
        "rlimits": rlimit_values(limits),
    }
    argv = ["python3", "-I", "-S", "-B", "-u", "-X", "utf8", "-c", BOOTSTRAP, repr(config)]
    started = time.monotonic()
    try:
        sandbox = modal.Sandbox.create(*argv, app=app, image=image, **sandbox_options(limits))
    except Exception as exc:
        raise SandboxUnavailable(f"cannot create a Modal sandbox: {type(exc).__name__}: {exc}", hint=HINT) from exc
    try:
        program = code.encode("utf-8", "surrogatepass")
        sandbox.stdin.write(b"%d\n" % len(program) + program + stdin.encode("utf-8", "replace"))
        sandbox.stdin.write_eof()
        sandbox.stdin.drain()
        deadline = started + limits.wall_seconds
        timed_out = False
        while sandbox.poll() is None:
            if time.monotonic() >= deadline:
                sandbox.terminate()
                timed_out = True
                break
            time.sleep(POLL_SECONDS)
        stdout, stderr = _read(sandbox.stdout, limits), _read(sandbox.stderr, limits)
        exit_code = -9 if timed_out else sandbox.returncode
    finally:
        if sandbox.poll() is None:
            sandbox.terminate()
    seconds = time.monotonic() - started
    exit_code = -9 if exit_code is None else int(exit_code)
    reason = reason_for(exit_code, timed_out, None, limits, seconds)
    return SandboxResult(
        ok=reason == "ok",
        stdout=stdout.text(),
        stderr=stderr.text(),
        exit_code=exit_code,
        reason=reason,
        seconds=seconds,
        cpu_seconds=None,
        truncated=stdout.dropped > 0 or stderr.dropped > 0,
        sandbox="modal",
    )


def _read(stream: Any, limits: SandboxLimits) -> Capture:
    capture = Capture(limits.max_output_bytes)
    for chunk in stream:
        capture.add(chunk.encode("utf-8", "replace") if isinstance(chunk, str) else bytes(chunk))
    return capture


__all__ = ["APP_NAME", "run_modal", "sandbox_options"]
