"""Naming a saved policy: `<run_id>@<step>`, `<run_id>@latest`, or `base`; and finding its run.

`tinkerless eval --checkpoint` and `tinkerless export` take these names. A run lives where a
`RunHost` says (a storage location, or the `tinkerless serve` server a backend talks to); its
state records the base model it trained, which a checkpoint only fits.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from tinkerless.errors import UserError

if TYPE_CHECKING:
    from tinkerless.coordinator import RunState

BASE = "base"
LATEST = "latest"
FORMS = "RUN_ID@STEP (e.g. my-run@20), RUN_ID@latest, or base (the model with no adapter)"
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


@dataclass(frozen=True)
class CheckpointRef:
    """A run's checkpoint (`step` None: its latest valid one), or the base model (`run_id` None)."""

    run_id: str | None
    step: int | None = None

    @property
    def is_base(self) -> bool:
        return self.run_id is None

    def __str__(self) -> str:
        if self.run_id is None:
            return BASE
        return f"{self.run_id}@{LATEST if self.step is None else self.step}"


def parse_checkpoint(spec: str) -> CheckpointRef:
    """`CheckpointRef` of a name in one of `FORMS`; a UserError naming what is wrong otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"checkpoint {spec!r} is empty", hint=f"name one as {FORMS}")
    spec = spec.strip()
    if spec == BASE:
        return CheckpointRef(None)
    run_id, at, step = spec.rpartition("@")
    if not at:
        raise UserError(
            f"checkpoint {spec!r} names no step",
            hint=f"write {spec}@latest for its newest checkpoint, or {spec}@STEP; the forms are {FORMS}",
        )
    if not _RUN_ID.fullmatch(run_id):
        raise UserError(f"checkpoint {spec!r}: {run_id!r} is not a run id", hint=f"run ids are listed by `tinkerless runs`; the forms are {FORMS}")
    if step == LATEST:
        return CheckpointRef(run_id)
    if not step.isdigit() or len(step) > 12:
        raise UserError(f"checkpoint {spec!r}: step {step!r} is not a whole number", hint=f"the forms are {FORMS}")
    return CheckpointRef(run_id, int(step))


def find_run(host, run_id: str) -> "RunState":
    """The state of run `run_id` where `host` keeps runs; a UserError naming the run and the runs there."""
    from tinkerless.coordinator import Coordinator, RunState, list_runs, state_key

    request = getattr(host, "request", None)
    if callable(request):  # a `tinkerless serve` server (ServerRunHost): ask it, lease-free (a reader)
        from tinkerless.sdk.backends.server_runs import _expect
        from tinkerless.wire.runs import RunCall, RunReply

        try:
            reply = request("/v1/runs/call/state", RunCall(run_id))
        except UserError as exc:
            if "does not exist" not in exc.message:
                raise
            raise _unknown_run(run_id, host.where, [r.run_id for r in host.list()]) from None
        _expect(reply, RunReply)
        return RunState.from_dict(reply.state)
    store = host.store
    if not store.exists(state_key(run_id)):
        raise _unknown_run(run_id, host.where, [r.run_id for r in list_runs(store)])
    return Coordinator.open(store, run_id).state  # reads state.json; takes no lease, changes nothing


def _unknown_run(run_id: str, where: str, known: list[str]) -> UserError:
    close = difflib.get_close_matches(run_id, known, n=1, cutoff=0.6)
    listing = f"runs there: {', '.join(known[:8])}{' ...' if len(known) > 8 else ''}" if known else "there are no runs there"
    guess = f"did you mean {close[0]!r}? " if close else ""
    return UserError(
        f"run {run_id!r} does not exist in {where}",
        hint=f"{guess}{listing}; `tinkerless runs` lists them (pass the --storage or --backend server the run used)",
    )


def run_model(state: "RunState") -> str | None:
    """The base model a run trained (its config's `model`)."""
    model = state.config.get("model") if isinstance(state.config, dict) else None
    return model if isinstance(model, str) and model else None


def same_model(a: str, b: str) -> bool:
    """Whether two model specs name the same base model: the same Hub id (aliases included) or directory."""
    from tinkerless.functions.models import public_model_id

    a, b = a.strip(), b.strip()
    if a == b or public_model_id(a) == public_model_id(b):
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()


def check_base_model(state: "RunState", model: str, what: str) -> None:
    """A checkpoint's adapter is only meaningful on the base model it was trained on: refuse any other."""
    trained_on = run_model(state)
    if trained_on is not None and not same_model(trained_on, model):
        raise UserError(
            f"{what} was trained on base model {trained_on!r}, not {model!r}",
            hint=f"use the run's base model (--model {trained_on}), or a checkpoint of a run on {model!r}",
        )
