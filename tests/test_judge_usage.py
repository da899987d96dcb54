"""A judge's work on a server is metered per key apart from the policy's own: GET /v1/usage and `tinkerless keys
usage` show the seconds the judge took, the tokens it read and its verdicts, and a key that judges nothing shows
none (its calls, judged or not, are still charged in full)."""

from __future__ import annotations

import httpx
import pytest

import tinkerless
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.sdk.cli.commands import main
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore

TASKS = [{"prompt": "Say hello."}, {"prompt": "Greet me."}]


@tinkerless.reward
def length(completion, task):
    return len(completion) / 100


def _usage(url: str, key: str) -> dict:
    response = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


def _train(tiny_model, url, key, reward, steps, storage):
    from tinkerless.sdk.run.trainer import train

    config = tinkerless.TrainConfig(model=tiny_model, reward=reward, tasks=TASKS, steps=steps, batch_size=2,
                                    group_size=3, max_tokens=5, progress=False, checkpoint_every=steps)
    return train(config, backend=HTTPBackend(url, api_key=key), storage=str(storage))


def test_a_keys_judge_is_metered_apart_from_its_policy_and_other_keys_see_none(tiny_model, worker, tmp_path, capsys):
    storage = tmp_path / "server"
    keys = KeyStore(ObjectStore(str(storage)))
    judged_key, plain_key = keys.create("lab"), keys.create("other", budget_usd=100.0)
    app = create_app(worker, keys=keys, storage=str(storage), price_per_hour=3600.0)
    with serve_in_thread(app) as url:
        judged = _train(tiny_model, url, judged_key, [length, tinkerless.judge("Polite and short.")], 2, tmp_path / "a")
        plain = _train(tiny_model, url, plain_key, length, 1, tmp_path / "b")
        mine, theirs = _usage(url, judged_key), _usage(url, plain_key)

    # every episode of both steps was a verdict (cached or not), and the tokens are the ones the run reported
    assert mine["judge_verdicts"] == 2 * 2 * 3
    assert mine["judge_tokens"] == sum(r["judge_prompt_tokens"] for r in judged.metrics) > 0
    assert mine["judge_seconds"] == pytest.approx(sum(r["judge_s"] for r in judged.metrics), rel=1e-6)
    assert 0 < mine["judge_seconds"] < mine["compute_seconds"]
    assert mine["policy_seconds"] == pytest.approx(mine["compute_seconds"] - mine["judge_seconds"])
    assert mine["judge_cache_hits"] <= mine["judge_verdicts"]
    assert mine["spent_usd"] == pytest.approx(mine["compute_seconds"])  # $1 a second: the judge is charged too
    # the key that judged nothing: charged for its policy's calls only, no judge figures
    assert plain.metrics and "judge_s" not in plain.metrics[0]
    assert theirs["judge_seconds"] == 0 and theirs["judge_tokens"] == 0 and theirs["judge_verdicts"] == 0
    assert theirs["compute_seconds"] > 0 and theirs["policy_seconds"] == theirs["compute_seconds"]

    # the server wrote them down: the command line shows the judge's part of the judged key only
    assert main(["keys", "usage", "--storage", str(storage)]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    judged_id, plain_id = judged_key.split("-")[1], plain_key.split("-")[1]
    assert f"{mine['judge_tokens']} tokens read, 12 verdicts" in rows[judged_id]
    assert "judge" not in rows[plain_id]
