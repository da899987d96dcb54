"""Validation of the coordinator calls a client makes on a server-hosted run (`/v1/runs/call/{method}`).

Each call takes only its own arguments, the required ones present, each of the right type and range, before
the server's coordinator sees them (`wait_rollouts(timeout=NaN)` would otherwise spin). The value checks are
`validate`'s own (`_check_number`, `check_json_object`, `between`): one set of rules for every wire value.
"""

from __future__ import annotations

from typing import Any, Callable

from tinkerless.errors import InvalidRequest
from tinkerless.wire.validate import MAX_STEP, _check_number, _fail, between, check_json_object

def _participants(value: Any, path: str) -> None:
    if not isinstance(value, list) or not value or not all(isinstance(p, str) and 0 < len(p) <= 128 for p in value):
        _fail(path, "must be a non-empty list of participant names (strings of 1-128 characters)")


def _participant(value: Any, path: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        _fail(path, "must be a participant name (a string of 1-128 characters)")


def _step(value: Any, path: str) -> None:
    _check_number(value, int, path)
    between(0, MAX_STEP)(value, path)


def _timeout(value: Any, path: str) -> None:
    if value is not None:
        _check_number(value, float, path)
        between(0)(value, path)


def _interval(value: Any, path: str) -> None:
    _check_number(value, float, path)
    between(0, 86400, low_open=True)(value, path)


def _optional_map(value: Any, path: str) -> None:
    if value is not None:
        if not isinstance(value, dict):
            _fail(path, f"must be a map or null, got {type(value).__name__}")
        check_json_object(value, path)  # it is written into the run's state.json


def _status(value: Any, path: str) -> None:
    if not isinstance(value, str) or value not in ("finished", "failed", "interrupted"):
        _fail(path, f"must be 'finished', 'failed' or 'interrupted', got {str(value)[:32]!r}")


RUN_CALL_ARGS: dict[str, dict[str, Callable[[Any, str], None]]] = {
    "create": {"config": _optional_map},
    "open": {"limits": _optional_map},  # the resuming driver's budget (server/run_budgets.py checks its values)
    "state": {},
    "begin_rollout": {"step": _step, "participants": _participants},
    "submit_rollout": {"step": _step, "participant": _participant},
    "wait_rollouts": {"step": _step, "timeout": _timeout},
    "begin_update": {"step": _step},
    "commit_update": {"step": _step, "metrics": _optional_map},
    "record_checkpoint": {"step": _step},
    "reset_to_checkpoint": {"step": _step, "config": _optional_map},
    "finish": {"status": _status, "summary": _optional_map},
    "heartbeat": {"interval": _interval},
}
_REQUIRED = {"begin_rollout": {"step"}, "submit_rollout": {"step", "participant"}, "wait_rollouts": {"step"},
             "begin_update": {"step"}, "commit_update": {"step"}, "record_checkpoint": {"step"},
             "reset_to_checkpoint": {"step"}, "heartbeat": {"interval"}}


def run_call_args(method: str, args: Any) -> dict:
    """The arguments of coordinator call `method`, checked: known names, required ones present, right types."""
    if method not in RUN_CALL_ARGS:
        raise InvalidRequest(
            f"unknown run call {method[:64]!r}",
            hint=f"the server knows {', '.join(RUN_CALL_ARGS)}; update the client or server",
        )
    schema = RUN_CALL_ARGS[method]
    if not isinstance(args, dict):
        _fail(f"{method} arguments", f"must be a map, got {type(args).__name__}")
    unknown = set(args) - set(schema)
    if unknown:
        _fail(f"{method}", f"takes {list(schema)}, not {sorted(map(str, unknown))}")
    missing = _REQUIRED.get(method, set()) - set(args)
    if missing:
        _fail(f"{method}", f"needs the arguments {sorted(missing)}")
    for name, value in args.items():
        schema[name](value, f"{method}({name}=...)")
    return args
