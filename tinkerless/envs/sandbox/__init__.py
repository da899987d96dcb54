"""Run model-written Python in a sandbox: `run_python(code) -> SandboxResult`.

Sandbox kinds (pick with `sandbox=` or the TINKERLESS_SANDBOX environment variable):

- "bwrap" (default): bubblewrap, kernel-enforced; see `bwrap.py` for what each call gets.
- "modal": a `modal.Sandbox` (gVisor) created from the worker; see `modal_sandbox.py`.
- "process-unsafe": the old process sandbox (limits, a process group, an audit hook).
  Never chosen automatically: where bubblewrap cannot run, "bwrap" raises
  `SandboxUnavailable` naming the fix instead of downgrading. Opting in logs a
  warning once per process.

Every kind returns the same `SandboxResult`: stdout and stderr (each bounded),
the exit status, and `reason`, which names the limit that stopped the run
("timeout", "cpu_limit", "memory_limit", "file_limit", "disk_limit",
"process_limit", "open_files_limit"), or "ok", "error", "forbidden", "crashed",
"killed". See docs/sandbox.md.
"""

from __future__ import annotations

import logging
import os
import threading

from tinkerless.envs.sandbox.limits import (
    BOOTSTRAP_EXIT_CODES,
    REASONS,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
)
from tinkerless.errors import ConfigError

SANDBOX_KINDS = ("bwrap", "modal", "process-unsafe")
DEFAULT_SANDBOX = "bwrap"
ENV_VAR = "TINKERLESS_SANDBOX"

logger = logging.getLogger("tinkerless.sandbox")
_warned_unsafe = threading.Event()


def sandbox_kind(sandbox: str | None = None) -> str:
    """The kind to use: the argument, else $TINKERLESS_SANDBOX, else "bwrap"; ConfigError for unknown names."""
    chosen = sandbox if sandbox is not None else (os.environ.get(ENV_VAR) or DEFAULT_SANDBOX)
    if chosen not in SANDBOX_KINDS:
        source = "sandbox=" if sandbox is not None else f"${ENV_VAR}="
        raise ConfigError(f"unknown sandbox {source}{chosen!r}", hint=f"use one of: {', '.join(SANDBOX_KINDS)}")
    return chosen


def run_python(
    code: str,
    *,
    limits: SandboxLimits = SandboxLimits(),
    stdin: str = "",
    sandbox: str | None = None,
    audit_hook: bool = True,
) -> SandboxResult:
    """Run `code` as a fresh Python program under `limits`; always returns within about `wall_seconds`.

    `audit_hook=False` leaves out the in-interpreter audit-hook layer (the attack
    suite uses it to show the kernel layer holds on its own).
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    if not isinstance(stdin, str):
        raise TypeError(f"stdin must be a str, got {type(stdin).__name__}")
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    kind = sandbox_kind(sandbox)
    config = {"max_processes": limits.max_processes, "exit_codes": sorted(BOOTSTRAP_EXIT_CODES), "audit_hook": bool(audit_hook)}
    if kind == "bwrap":
        from tinkerless.envs.sandbox.bwrap import run_bwrap

        return run_bwrap(code, limits=limits, stdin=stdin, config=config)
    if kind == "modal":
        from tinkerless.envs.sandbox.modal_sandbox import run_modal

        return run_modal(code, limits=limits, stdin=stdin, config=config)
    if not _warned_unsafe.is_set():
        _warned_unsafe.set()
        logger.warning(
            "sandbox='process-unsafe': model-written code runs in a plain process with an audit hook, which hostile "
            "code can remove; use the default sandbox='bwrap' (bubblewrap) for anything you do not trust"
        )
    from tinkerless.envs.sandbox.process_unsafe import run_process_unsafe

    return run_process_unsafe(code, limits=limits, stdin=stdin, config=config)


__all__ = ["REASONS", "SANDBOX_KINDS", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "sandbox_kind"]
