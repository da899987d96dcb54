"""Budgets per API key on a server: a call that would spend past its key's budget is refused before its work
(HTTP 402 in each API's error shape), concurrent calls reserve first, and budgets are checked at the boundary."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import pytest

from tinkerless.errors import BudgetExceeded, UserError
from tinkerless.functions.models import resolve_model
from tinkerless.sdk.cli.commands import main
from tinkerless.server import create_app
from tinkerless.server import serve_in_thread as running
from tinkerless.server.budgets import USAGE_FILE
from tinkerless.server.keys import KeyStore, check_budget, parse_budget
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.http import COMPUTE_SECONDS_HEADER
from tinkerless.wire.messages import ErrorReply, SampleRequest, SamplingParams

PRICE = 3600.0  # $ per hour: a second of compute costs $1, so budgets of a few dollars last a few calls
MSGPACK = {"Content-Type": "application/msgpack"}


def _sample_body(seed: int, tokens: int = 6) -> bytes:
    return encode_message(SampleRequest("base", [[1, 2, 3, 4, 5]], 1, SamplingParams(max_tokens=tokens, temperature=1.0),
                                        seed))


def _key_id(key: str) -> str:
    return key.split("-")[1]


@pytest.fixture
def budgeted(worker, tmp_path):
    keys = KeyStore(ObjectStore(str(tmp_path)))
    with running(create_app(worker, keys=keys, storage=str(tmp_path), price_per_hour=PRICE)) as url:
        yield url, keys, tmp_path


def _usage(url: str, key: str) -> dict:
    response = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_sixteen_concurrent_calls_near_the_budget_overspend_by_at_most_one_calls_worth(budgeted):
    url, keys, _ = budgeted
    key = keys.create("lab")
    auth = {**MSGPACK, "Authorization": f"Bearer {key}"}
    for seed in range(3):  # the server learns how long a call of this kind takes
        assert httpx.post(f"{url}/v1/call/sample", content=_sample_body(seed), headers=auth).status_code == 200
    before = _usage(url, key)
    keys.set_budget(_key_id(key), before["spent_usd"] + 4 * before["spent_usd"] / before["calls"])  # ~4 more calls
    answers: list[httpx.Response] = []
    lock, start = threading.Lock(), threading.Barrier(16)

    def call(seed: int) -> None:
        start.wait()
        response = httpx.post(f"{url}/v1/call/sample", content=_sample_body(100 + seed), headers=auth, timeout=120)
        with lock:
            answers.append(response)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ran = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 402]
    assert len(ran) + len(refused) == 16 and ran and refused
    after = _usage(url, key)
    one_call = max(float(a.headers[COMPUTE_SECONDS_HEADER]) for a in ran) * PRICE / 3600
    assert after["calls"] == before["calls"] + len(ran) and after["reserved_usd"] == 0.0
    assert after["spent_usd"] <= after["budget_usd"] + one_call, (after, one_call)
    refusal = decode_message(refused[0].content)
    assert isinstance(refusal, ErrorReply) and refusal.type == "BudgetExceeded" and refusal.category == "user"
    assert f"API key {_key_id(key)} has spent $" in refusal.error and "budget" in refusal.error
    assert f"tinkerless keys set-budget {_key_id(key)} --budget-usd" in refusal.hint
    # Raised, the key's calls run again; a later call after a refusal is not held behind its sequence number.
    keys.set_budget(_key_id(key), after["spent_usd"] + 10)
    assert httpx.post(f"{url}/v1/call/sample", content=_sample_body(7), headers=auth).status_code == 200
    time.sleep(1.5)  # spending reaches storage within a second
    stored = json.loads((budgeted[2] / USAGE_FILE).read_text())[_key_id(key)]
    assert stored["calls"] == after["calls"] + 1  # kept in the server's storage: a restart goes on counting


def test_a_spent_key_is_refused_in_every_apis_error_shape(budgeted, worker):
    url, keys, _ = budgeted
    key = keys.create("lab", budget_usd=0.0)  # nothing to spend: every call that would run is refused
    other = keys.create("lab", budget_usd=None)
    bearer = {"Authorization": f"Bearer {key}"}
    wire = httpx.post(f"{url}/v1/call/sample", content=_sample_body(1), headers={**MSGPACK, **bearer})
    assert wire.status_code == 402 and decode_message(wire.content).type == "BudgetExceeded"
    openai = httpx.post(f"{url}/v1/completions", headers=bearer, json={"model": worker.model_name, "prompt": "hi", "max_tokens": 2})
    assert openai.status_code == 402, openai.text
    error = openai.json()["error"]
    assert error["type"] == "insufficient_quota" and error["code"] == "budget_exceeded" and "$0.0000 budget" in error["message"]
    tinker = httpx.post(f"{url}/api/v1/asample", headers={"X-API-Key": key}, json={
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "num_samples": 1,
        "sampling_params": {"max_tokens": 2}, "base_model": resolve_model(worker.model_name)})
    assert tinker.status_code == 402 and tinker.json()["category"] == "user" and "set-budget" in tinker.json()["error"]
    assert tinker.headers["x-should-retry"] == "false"  # the official SDK obeys it (tinker._base_client._should_retry)
    assert _usage(url, key)["calls"] == 0  # refused before any work: nothing spent
    # Another key of the same tenant, without a budget, is not held by this one's.
    assert httpx.post(f"{url}/v1/call/sample", content=_sample_body(1),
                      headers={**MSGPACK, "Authorization": f"Bearer {other}"}).status_code == 200


@pytest.mark.parametrize("bad", [-1, -0.01, math.nan, math.inf, -math.inf, 1e10, "5", True, [5], {"usd": 5}])
def test_hostile_budgets_are_refused_at_the_boundary(tmp_path, bad):
    keys = KeyStore(ObjectStore(str(tmp_path)))
    with pytest.raises(UserError, match="budget_usd"):
        keys.create("lab", budget_usd=bad)
    key = keys.create("lab", budget_usd=3)
    with pytest.raises(UserError, match="budget_usd"):
        keys.set_budget(_key_id(key), bad)
    assert keys.record(_key_id(key)).budget_usd == 3.0 and check_budget(None) is None


def test_hostile_budgets_typed_on_the_command_line_are_refused(tmp_path, capsys):
    for text in ["-1", "nan", "NaN", "inf", "-inf", "1e10", "five", "", "0x10", "1,5", "$5", "1e999"]:
        with pytest.raises(UserError):
            parse_budget(text)
    for text in ["nan", "-1"]:
        assert main(["keys", "create", "--tenant", "lab", "--budget-usd", text, "--storage", str(tmp_path)]) != 0
    assert KeyStore(ObjectStore(str(tmp_path))).list() == []  # no key was made
    assert "not a number of dollars" in capsys.readouterr().err


def test_keys_cli_creates_budgets_sets_them_and_shows_usage(tmp_path, capsys):
    assert main(["keys", "create", "--tenant", "lab", "--budget-usd", "2.5", "--storage", str(tmp_path)]) == 0
    key = capsys.readouterr().out.strip()
    keys = KeyStore(ObjectStore(str(tmp_path)))
    assert keys.record(_key_id(key)).budget_usd == 2.5
    assert main(["keys", "set-budget", _key_id(key), "--budget-usd", "7", "--storage", str(tmp_path)]) == 0
    assert keys.record(_key_id(key)).budget_usd == 7.0
    assert main(["keys", "usage", "--storage", str(tmp_path)]) == 0
    listed = capsys.readouterr().out
    assert f"{_key_id(key)}  lab" in listed and "$0.0000 of $7.00" in listed
    assert main(["keys", "set-budget", _key_id(key), "--budget-usd", "none", "--storage", str(tmp_path)]) == 0
    assert keys.record(_key_id(key)).budget_usd is None
    assert main(["keys", "set-budget", "nosuchid", "--budget-usd", "3", "--storage", str(tmp_path)]) != 0


def test_usage_needs_a_metered_key(budgeted, worker, tmp_path):
    url, keys, _ = budgeted
    assert httpx.get(f"{url}/v1/usage").status_code == 401
    with running(create_app(worker, storage=str(tmp_path / "open"))) as open_url:  # no keys: nothing metered per key
        assert httpx.get(f"{open_url}/v1/usage").status_code == 404


def test_budget_exceeded_is_rebuilt_on_the_client():
    from tinkerless.errors import rebuild_error

    error = rebuild_error("BudgetExceeded", "spent", hint="raise it")
    assert isinstance(error, BudgetExceeded) and error.category == "user"
