"""Pay-per-use accounting: prices, per-phase device seconds in real tiny-model runs (local and over HTTP), `tinkerless runs`."""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import httpx
import pytest

import tinkerless
from tinkerless.coordinator import Coordinator
from tinkerless.errors import ConfigError
from tinkerless.sdk.run.accounting import COMPUTE_SECONDS_HEADER, PHASES, PriceTable, RunUsage, UsageMeter, format_cost
from tinkerless.sdk.backends.base import LocalBackend, call
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.run.metrics import read_metrics
from tinkerless.server import create_app, serve_in_thread
from tinkerless.storage import ObjectStore

# The phases of these runs (no teacher, no judge: those have tests of their own, test_distillation, test_judge).
RUN_PHASES = [p for p in PHASES if p not in ("teacher", "judge")]
STEP_PHASES = [p for p in RUN_PHASES if p != "setup"]


@tinkerless.reward
def text_score(completion, task):
    # Distinct completions score differently, so every group has advantages and every step updates.
    return float(sum((i + 1) * ord(c) for i, c in enumerate(completion)) % 1000) / 1000


def _train(tiny_model, storage, backend, *, run_id, steps=2, **settings):
    options = {
        "model": tiny_model,
        "reward": text_score,
        "tasks": [{"prompt": "2+3?"}, {"prompt": "1+1?"}],
        "steps": steps,
        "batch_size": 2,
        "group_size": 2,
        "max_tokens": 4,
        "temperature": 1.0,
        "kl_coef": 0.01,  # a forward pass per step, so the forward phase has compute too
        "checkpoint_every": 1,
        "seed": 0,
        "storage": str(storage),
        "progress": False,
        "run_id": run_id,
        "backend": backend,
    }
    return tinkerless.train(**{**options, **settings})


def _run_summary(storage, run_id) -> dict:
    return Coordinator.open(ObjectStore(str(storage)), run_id).state.summary


def _check_last_line_total(last: dict, usage: dict) -> None:
    """Only the final checkpoint, written after the last metrics line, separates its total from the run's."""
    after_last_line = usage["compute_seconds_total"] - last["compute_s/total"]
    assert 0 < after_last_line <= usage["compute_seconds"]["storage"] + 1e-9


def _check_step_columns(records: list[dict], price_per_hour: float) -> None:
    previous_total = 0.0
    for record in records:
        assert record["trained_sequences"] > 0, record  # the setup of these runs: every step updates
        for phase in STEP_PHASES:
            # A step's checkpoint is written after its metrics line, so its storage time shows in the next line.
            if phase == "storage" and record["step"] == records[0]["step"]:
                continue
            assert record[f"compute_s/{phase}"] > 0, (phase, record)
            # compute measured where it ran fits inside the client's wall time of the phase
            assert record[f"compute_s/{phase}"] <= record[f"{phase}_s"] + 1e-6
        assert record["compute_s/step"] == pytest.approx(sum(record[f"compute_s/{p}"] for p in PHASES if p != "setup"))
        assert record["compute_s/total"] >= previous_total + record["compute_s/step"] - 1e-9  # cumulative (step 0 adds setup)
        assert record["cost_usd"] == pytest.approx(record["compute_s/total"] * price_per_hour / 3600)
        previous_total = record["compute_s/total"]


def _check_summary(usage: dict, *, device: str, price_per_hour: float, calls: dict[str, int]) -> None:
    assert usage["device"] == device
    assert usage["price_per_hour"] == price_per_hour
    assert set(usage["compute_seconds"]) == set(PHASES)
    assert all(usage["compute_seconds"][p] > 0 for p in RUN_PHASES)
    assert sum(usage["compute_seconds"].values()) == pytest.approx(usage["compute_seconds_total"])
    assert sum(f["seconds"] for f in usage["by_function"].values()) == pytest.approx(usage["compute_seconds_total"])
    assert {m: f["calls"] for m, f in usage["by_function"].items()} == calls
    assert usage["cost_usd"] == pytest.approx(usage["compute_seconds_total"] * price_per_hour / 3600)


# ---- prices ----------------------------------------------------------------------------------------


def test_default_prices_by_device_name():
    table = PriceTable()
    assert table.cost("NVIDIA H100 80GB HBM3", 3600) == pytest.approx(3.95)  # 1 h of H100 at $3.95/h
    assert table.cost("NVIDIA L4", 1800) == pytest.approx(0.40)
    assert table.cost("Tesla T4", 60) == pytest.approx(0.59 / 60)
    expected = {
        "H100": 3.95,  # Modal's GPU type strings match as well as CUDA device names
        "NVIDIA H200": 4.54,
        "NVIDIA A100-SXM4-80GB": 2.50,
        "A100-80GB": 2.50,
        "NVIDIA A100-SXM4-40GB": 2.10,
        "NVIDIA L40S": 1.95,  # not the L4 price: keys match whole words
        "NVIDIA A10G": 1.10,
        "cpu": 0.0,
    }
    assert {device: table.per_hour(device) for device in expected} == expected


def test_user_prices_override_defaults():
    assert PriceTable({"H100": 2.0}).cost("NVIDIA H100 80GB HBM3", 1800) == pytest.approx(1.0)
    # the user's keys come first, even a less specific one
    assert PriceTable({"nvidia": 1.5}).per_hour("NVIDIA H100 80GB HBM3") == 1.5
    # among the user's keys the most specific wins
    table = PriceTable({"A100": 1.0, "A100 80GB": 1.8})
    assert table.per_hour("NVIDIA A100-SXM4-80GB") == 1.8 and table.per_hour("NVIDIA A100-SXM4-40GB") == 1.0
    assert table.per_hour("NVIDIA L4") == 0.80  # devices without a user key keep the default price
    # a flat price covers every device, known or not
    flat = PriceTable({"H100": 2.0}, price_per_hour=7.2)
    assert flat.cost("cpu", 10) == pytest.approx(0.02) and flat.cost("TPU v5e", 3600) == pytest.approx(7.2)


def test_unknown_device_costs_none_with_one_warning():
    table = PriceTable()
    with pytest.warns(UserWarning, match=r"no price known for device 'cuda'.*prices=.*price_per_hour"):
        assert table.cost("cuda", 100.0) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning for the same device would raise here
        assert table.cost("cuda", 5.0) is None
    assert table.per_hour("NVIDIA GH200 480GB") is None  # GH200 is not H200


def test_run_usage_adds_and_prices_an_earlier_attempt():
    prior = {
        "device": "cuda",
        "gpu_seconds": {"rollout": 100.0},
        "gpu_seconds_total": 100.0,
        "by_function": {"rollout": {"seconds": 100.0, "calls": 4}},
        "cost_usd": None,  # that attempt had no price for "cuda"
    }
    meter = UsageMeter(device="cuda")
    meter.record("rollout", 3.0)  # before this run: another user of the backend, not billed here
    usage = RunUsage(meter, PriceTable({"cuda": 3.6}), prior=prior)
    with usage.phase("update"):
        meter.record("update", 50.0)
    summary = usage.summary()
    assert summary["compute_seconds"] == {"setup": 0.0, "rollout": 100.0, "forward": 0.0, "teacher": 0.0, "judge": 0.0,
                                        "update": 50.0, "storage": 0.0}
    assert summary["by_function"] == {"rollout": {"seconds": 100.0, "calls": 4}, "update": {"seconds": 50.0, "calls": 1}}
    assert summary["cost_usd"] == pytest.approx(150.0 * 3.6 / 3600)  # the price given now covers the earlier seconds
    with pytest.warns(UserWarning, match="'cuda'"):
        assert RunUsage(meter, PriceTable(), prior=prior).cost_usd() is None


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"prices": {"H100": -1.0}}, "non-negative number"),
        ({"prices": {"H100": "3.95"}}, "non-negative number"),
        ({"prices": {"--": 1.0}}, "names no device"),
        ({"prices": [("H100", 1.0)]}, "must be a dict"),
        ({"price_per_hour": float("nan")}, "non-negative number"),
    ],
)
def test_bad_prices_are_config_errors(settings, message):
    config = tinkerless.TrainConfig(reward=text_score, tasks=[{"prompt": "x"}], **settings)
    with pytest.raises(ConfigError, match=message) as info:
        config.validate()
    assert info.value.hint


# ---- a real run on the local backend ---------------------------------------------------------------


@pytest.fixture(scope="module")
def local_run(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("acct-local")
    backend = LocalBackend(tiny_model)
    result = _train(tiny_model, storage, backend, run_id="acct-local", prices={"cpu": 7.2})
    return storage, backend, result


def test_local_run_records_seconds_per_phase_and_function(local_run):
    storage, backend, result = local_run
    assert backend.usage.device == "cpu"
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    _check_step_columns(records, price_per_hour=7.2)

    usage = _run_summary(storage, "acct-local")["usage"]
    assert usage == result.usage
    calls = {"create_policy": 1, "rollout": 2, "forward": 2, "update": 2, "save_state": 2}
    _check_summary(usage, device="cpu", price_per_hour=7.2, calls=calls)
    assert usage["measured_by"] == "the in-process worker" and usage["client_timed_calls"] == 0
    _check_last_line_total(records[-1], usage)
    # the meter of the (fresh) backend saw exactly this run's calls, plus the one that frees the
    # run's policy after its usage was written
    metered = backend.usage.seconds()
    assert backend.usage.calls()["delete_policy"] == 1
    metered.pop("delete_policy")
    assert metered == pytest.approx({m: f["seconds"] for m, f in usage["by_function"].items()})


def test_price_override_changes_the_cost(local_run):
    _, _, result = local_run
    seconds = result.usage["compute_seconds_total"]
    assert result.usage["cost_usd"] == pytest.approx(seconds * 7.2 / 3600) and result.usage["cost_usd"] > 0
    assert PriceTable().cost("cpu", seconds) == 0.0  # without the override the local CPU is free


def test_final_report_and_runs_listing_show_usage(local_run, capsys):
    storage, _, result = local_run
    usage = result.usage
    code = main(["runs", "--storage", str(storage)])
    out = capsys.readouterr().out
    assert code == 0
    header, *rows = out.strip().splitlines()
    assert "GPU-SECONDS" in header and "COST" in header
    (row,) = [r for r in rows if r.startswith("acct-local ")]
    assert row.split()[-3:] == [f"{usage['compute_seconds_total']:.1f}", format_cost(usage["cost_usd"]), "cpu"]

    from tinkerless.sdk.run.progress import final_report as _final_report

    report = _final_report(result)
    match = re.search(r"compute: (\d+\.\d+) CPU-seconds on cpu \(setup \d+\.\d+, rollout \d+\.\d+, forward ", report)
    assert match, report
    assert float(match.group(1)) == pytest.approx(usage["compute_seconds_total"], abs=0.01)
    assert f"{format_cost(usage['cost_usd'])} at $7.20/h" in report


def test_resumed_run_adds_to_the_earlier_usage(local_run, tiny_model, capsys):
    storage, backend, first = local_run
    before = first.usage
    # one more step at a flat $3600/h ($1 per second), on the same worker
    resumed = _train(tiny_model, storage, backend, run_id="acct-local", steps=3, resume=True, price_per_hour=3600.0)
    usage = resumed.usage
    added = usage["compute_seconds_total"] - before["compute_seconds_total"]
    assert added > 0
    assert usage["cost_usd"] == pytest.approx(before["cost_usd"] + added * 1.0)
    # every phase and function total only grew: the earlier attempt's compute stays billed
    assert all(usage["compute_seconds"][p] >= before["compute_seconds"][p] for p in PHASES)
    assert usage["by_function"]["load_state"]["calls"] == 1 and usage["by_function"]["rollout"]["calls"] == 3
    assert _run_summary(storage, "acct-local")["usage"] == usage
    last = read_metrics(resumed.run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 2
    _check_last_line_total(last, usage)


# ---- a real run over HTTP: the server's seconds are what is billed ---------------------------------


def test_http_run_bills_the_seconds_the_server_reports(tiny_model, tmp_path):
    from tinkerless.functions.worker import Worker

    sent: dict[str, list[float]] = defaultdict(list)

    def capture(response: httpx.Response) -> None:
        if COMPUTE_SECONDS_HEADER not in response.headers:
            return  # coordinator calls: the run's state on the server, no compute
        path = response.request.url.path
        name = "save_checkpoint" if path == "/v1/runs/checkpoint/save" else path.rsplit("/", 1)[-1]
        sent[name].append(float(response.headers[COMPUTE_SECONDS_HEADER]))

    server = tmp_path / "server"
    with serve_in_thread(create_app(Worker(tiny_model), storage=str(server))) as url:
        backend = HTTPBackend(url, timeout=120)
        backend._client.event_hooks["response"].append(capture)  # observe the real replies' headers
        result = _train(tiny_model, tmp_path, backend, run_id="acct-http")

    usage = _run_summary(server / "tenants/_", "acct-http")["usage"]  # the server keeps the run's state
    assert usage == result.usage
    # The server saves the checkpoints from its own worker: one save_checkpoint call per checkpoint.
    calls = {"info": 1, "create_policy": 1, "rollout": 2, "forward": 2, "update": 2, "save_checkpoint": 2}
    _check_summary(usage, device="cpu", price_per_hour=0.0, calls=calls)  # device from the worker's info reply
    assert usage["measured_by"].startswith("the server") and usage["client_timed_calls"] == 0
    # What the client's meter holds is exactly what the server said in its headers, including the one
    # delete_policy call by which the run frees its policy after its usage was written (not billed to the run).
    assert backend.usage.seconds() == pytest.approx({m: sum(v) for m, v in sent.items()}, abs=1e-9)
    assert len(sent.pop("delete_policy")) == 1
    # what was billed per function is exactly what the server said in its headers
    assert {m: len(v) for m, v in sent.items()} == calls
    assert {m: f["seconds"] for m, f in usage["by_function"].items()} == pytest.approx(
        {m: sum(v) for m, v in sent.items()}, abs=1e-9
    )
    records = read_metrics(result.run_dir / "metrics.jsonl")
    _check_step_columns(records, price_per_hour=0.0)
    _check_last_line_total(records[-1], usage)


def test_reply_without_the_header_is_billed_at_client_wall_time(tiny_model):
    from tinkerless.functions.worker import Worker

    app = create_app(Worker(tiny_model))

    @app.middleware("http")
    async def drop_compute_header(request, call_next):  # like a proxy that strips unknown headers
        response = await call_next(request)
        if COMPUTE_SECONDS_HEADER in response.headers:
            del response.headers[COMPUTE_SECONDS_HEADER]
        return response

    with serve_in_thread(app) as url:
        backend = HTTPBackend(url)
        assert call(backend, "info", {})["device"] == "cpu"
        backend.close()
    assert backend.usage.calls() == {"info": 1} and backend.usage.client_timed_calls() == 1
    assert backend.usage.seconds()["info"] > 0


# ---- a user's backend without a meter ----------------------------------------------------------------


class _BareBackend:
    """A user-written backend that keeps no `usage`: the trainer falls back to client wall time."""

    name = "bare"

    def __init__(self, model: str):
        from tinkerless.functions.worker import Worker

        self.worker = Worker(model)

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        return self.worker.handle(method, payload)

    def close(self) -> None:
        pass


def test_backend_without_usage_is_billed_at_client_wall_time(tiny_model, tmp_path):
    result = _train(tiny_model, tmp_path, _BareBackend(tiny_model), run_id="acct-bare", steps=1, price_per_hour=36.0)
    usage = result.usage
    calls = {"info": 1, "create_policy": 1, "rollout": 1, "forward": 1, "update": 1, "save_state": 1}
    _check_summary(usage, device="cpu", price_per_hour=36.0, calls=calls)
    assert usage["measured_by"].startswith("client wall time") and usage["client_timed_calls"] == sum(calls.values())


def test_metrics_and_usage_written_before_the_rename_still_read(tmp_path):
    """Runs written while the figures were called gpu_s / gpu_seconds: their metrics, listing and resume."""
    from tinkerless.sdk.run.accounting import latest_usage, seconds_by_phase, seconds_total
    from tinkerless.sdk.run.metrics import plot_metrics, read_metrics

    old = tmp_path / "metrics.jsonl"
    old.write_text('{"step": 0, "reward_mean": 0.5, "loss": 0.1, "gpu_s/rollout": 1.5, "gpu_s/total": 2.0}\n'
                   '{"step": 1, "reward_mean": 0.7, "loss": 0.1, "gpu_s/rollout": 1.0, "gpu_s/total": 3.5}\n')
    records = read_metrics(old)
    assert [r["compute_s/total"] for r in records] == [2.0, 3.5] and "gpu_s/total" not in records[0]
    assert plot_metrics(old, tmp_path / "metrics.png")
    usage = {"device": "cuda", "gpu_seconds": {"rollout": 3.0}, "gpu_seconds_total": 3.0, "cost_usd": None}
    assert seconds_total(usage) == 3.0 and seconds_by_phase(usage) == {"rollout": 3.0}
    assert latest_usage({"usage": usage}) is usage
    prior_run = RunUsage(UsageMeter(device="cuda"), PriceTable({"cuda": 3.6}), prior=usage)
    assert prior_run.total_seconds() == 3.0 and prior_run.summary()["compute_seconds"]["rollout"] == 3.0
