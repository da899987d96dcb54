"""A run hosted on `tinkerless serve` carries its own budget, and the server holds it: a call of that run that would
spend past it is refused before its work (402, reserve and settle as for keys), whatever its client checks."""

from __future__ import annotations

import json
import math

import pytest

import tinkerless
from tinkerless.errors import BudgetExceeded, TinkerlessError
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.backends.server_runs import ServerRunHost
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.run_budgets import RUN_USAGE_FILE
from tinkerless.wire.messages import SampleRequest, SamplingParams

LIMIT = 1.6  # device-seconds: the first call of a kind is expected to take 1.5 s, so it fits once


def _sample(client: HTTPBackend, seed: int):
    return call(client, "sample", SampleRequest("base", [[1, 2, 3, 4, 5]] * 4, 1, SamplingParams(max_tokens=24, temperature=1.0), seed))


def _stored(storage, run_id: str) -> dict:
    return json.loads((storage / "tenants" / "_" / "runs" / run_id / RUN_USAGE_FILE).read_text())


@pytest.fixture
def fresh_worker(tiny_model):
    return Worker(tiny_model)  # these runs train: not the shared read-only worker


def test_a_runs_calls_past_its_budget_are_refused_before_their_work_and_it_survives_a_restart(fresh_worker, tmp_path):
    storage = tmp_path / "server"
    app = create_app(fresh_worker, storage=str(storage))
    with running(app) as url:
        driver, other = HTTPBackend(url), HTTPBackend(url)
        runs = ServerRunHost(driver)
        run = runs.create("r", {"name": "r", "max_compute_seconds": LIMIT})
        done = 0
        with pytest.raises(BudgetExceeded) as caught:
            for seed in range(500):
                _sample(driver, seed)
                done += 1
        assert done >= 1  # the first call fits its 1.5 s reservation
        usage = _usage_of(app, "r")  # the server's own count of the run
        assert usage["calls"] == done and usage["reserved_seconds"] == 0.0  # the refused call did no work, holds nothing
        longest = usage["longest"]
        # Reserve and settle: the run never goes past its limit by more than one call's worth.
        assert usage["compute_seconds"] <= LIMIT + longest
        message = caught.value.message
        assert "run 'r' has used" in message and f"max_compute_seconds={LIMIT:g}" in message and "not started" in message
        assert "resume=True" in caught.value.hint and caught.value.category == "user"
        # Another client of the same server (no run, or another run) is not charged to this run.
        _sample(other, 0)
        assert _usage_of(app, "r")["calls"] == done
    # What the run spent is in the server's storage: a restarted server goes on counting, and refuses at once.
    assert _stored(storage, "r")["calls"] == done and math.isclose(_stored(storage, "r")["compute_seconds"], usage["compute_seconds"])
    app = create_app(fresh_worker, storage=str(storage))
    with running(app) as url:
        driver = HTTPBackend(url)
        run = ServerRunHost(driver).open("r")
        with pytest.raises(BudgetExceeded):
            _sample(driver, 1000)
        # The run raises its limit (a resume's config): its next calls go through.
        run.reset_to_checkpoint(0, {"name": "r", "max_compute_seconds": 1e6})
        _sample(driver, 1001)
        assert _usage_of(app, "r")["calls"] == done + 1


def _usage_of(app, run_id: str) -> dict:
    """The server's count for a run (its RunBudgets, which the refusal reads), and its longest call."""
    budgets = app.state.runs.budgets
    usage = budgets.usage("", run_id)
    usage["longest"] = max((s for (run, _), s in budgets._longest.items() if run == ("", run_id)), default=0.0)
    return usage


@pytest.mark.parametrize("bad", [-1, 0, math.nan, math.inf, 1e10, "5", True, [1]])
def test_hostile_run_limits_are_refused_at_the_servers_boundary(fresh_worker, tmp_path, bad):
    with running(create_app(fresh_worker, storage=str(tmp_path))) as url:
        runs = ServerRunHost(HTTPBackend(url))
        for name in ("max_compute_seconds", "max_cost_usd"):
            with pytest.raises(TinkerlessError) as caught:
                runs.create(f"h-{name}", {"name": "h", name: bad})
            assert caught.value.category == "user" and name in caught.value.message
        run = runs.create("ok", {"name": "ok", "max_cost_usd": 2.0})  # a sane one is kept; a resume cannot smuggle one
        with pytest.raises(TinkerlessError) as caught:
            run.reset_to_checkpoint(0, {"name": "ok", "max_cost_usd": bad})
        assert caught.value.category == "user"
        with pytest.raises(TinkerlessError) as caught:  # nor an open (a resuming driver's budget)
            runs.open("ok", limits={"max_compute_seconds": bad})
        assert caught.value.category == "user" and "max_compute_seconds" in caught.value.message


def test_a_training_run_whose_client_does_not_stop_it_is_stopped_by_the_server(tiny_model, fresh_worker, tmp_path):
    # Before its first step a run's own check has no step to go by (it expects the costliest step so far), so it
    # starts; the server, which holds the run's limit, refuses the first call that would not fit.
    settings = dict(model=tiny_model, reward=lambda c, t: float(len(c) % 3), tasks=lambda rng: {"prompt": f"n {rng.randint(0, 9)}"},
                    steps=2, batch_size=2, group_size=2, max_tokens=4, temperature=1.0, checkpoint_every=1, seed=3,
                    storage=str(tmp_path / "client"), progress=False, run_id="t")
    app = create_app(fresh_worker, storage=str(tmp_path / "server"))
    with running(app) as url:
        with pytest.raises(BudgetExceeded) as caught:
            tinkerless.train(**settings, backend=HTTPBackend(url), max_compute_seconds=0.5)
        assert "on this server" in caught.value.message and "max_compute_seconds=0.5" in caught.value.message
        assert _usage_of(app, "t")["calls"] == 0  # refused before any work of the run
        state = json.loads((tmp_path / "server" / "tenants" / "_" / "runs" / "t" / "state.json").read_text())
        assert state["status"] == "interrupted"
        # Raised, it resumes and finishes on the same server.
        resumed = tinkerless.train(**{**settings, "run_id": "t"}, backend=HTTPBackend(url), resume=True, max_compute_seconds=1e6)
        assert [m["step"] for m in resumed.metrics] == [0, 1]
