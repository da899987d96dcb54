"""The capture endpoint: an agent in another process and language (a bash script driving curl) calls the rollout's
policy through Chat Completions, Responses and Messages, and posts its reward; every call is recorded into its
episode under the same proof as an in-process agent's. Failures (no reward, a bad key, a hang past agent_timeout)
end only that episode."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest

import tinkerless
from tinkerless.functions.hosting.agent_functions import run_agent_episodes
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams

pytestmark = pytest.mark.timeout(120)

SCRIPT = r"""
set -eu
id=$(printf '%s' "$TINKERLESS_TASK" | sed -e 's/.*"id": *"\([^"]*\)".*/\1/')
mode=$(printf '%s' "$TINKERLESS_TASK" | sed -e 's/.*"mode": *"\([^"]*\)".*/\1/')
if [ "$mode" = "hang" ]; then echo $$ > "$OUT/$id.pid"; sleep 60; fi
auth="Authorization: Bearer $TINKERLESS_API_KEY"
if [ "$mode" = "bad_key" ]; then auth="Authorization: Bearer not-an-episode"; fi
post() { curl -sS -o "$OUT/$id-$1.json" -w '%{http_code}' -H "$auth" -H 'Content-Type: application/json' -d "$3" "$2"; }
code=$(post chat "$OPENAI_BASE_URL/chat/completions" '{"model": "policy", "messages": [{"role": "user", "content": "hi"}]}')
echo "chat $code" >&2
[ "$code" = 200 ] || exit 3
post responses "$OPENAI_BASE_URL/responses" '{"model": "policy", "input": "and?"}' > /dev/null
post messages "$ANTHROPIC_BASE_URL/v1/messages" '{"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}' > /dev/null
if [ "$mode" = "no_reward" ]; then exit 0; fi
post reward "$TINKERLESS_REWARD_URL" '{"reward": 0.25, "metrics": {"calls": 3}}' > /dev/null
code=$(post again "$TINKERLESS_REWARD_URL" '{"reward": 1.0}')
echo "again $code" >&2; [ "$code" = 409 ] || { cat "$OUT/$id-reward.json" "$OUT/$id-again.json" >&2; exit 4; }
"""


def _play(worker, agent, tasks, timeout=30.0):
    return run_agent_episodes(
        worker.engine, worker.tokenizer, agent=agent, policy=BASE_POLICY, tasks=tasks, group_size=1,
        sampling=SamplingParams(max_tokens=5, temperature=1.0), limits=EpisodeLimits(8, 4096), seed=2,
        timeout=timeout)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "agent.sh"
    path.write_text(textwrap.dedent(SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    return path, out


def test_an_external_program_is_recorded_through_every_api_under_the_proof(worker, script):
    path, out = script
    agent = tinkerless.external_agent(["bash", str(path)], env={"OUT": str(out)})
    tasks = [{"id": f"t{i}", "mode": "ok"} for i in range(3)]
    episodes = _play(worker, agent, tasks)
    assert [e.status for e in episodes] == ["ok"] * 3, [e.error for e in episodes]
    for task, episode in zip(tasks, episodes):
        assert episode.reward == 0.25 and episode.info["agent_metrics"] == {"calls": 3.0} and episode.num_turns == 3
        replies = [json.loads((out / f"{task['id']}-{api}.json").read_text()) for api in ("chat", "responses", "messages")]
        drawn = [replies[0]["usage"]["completion_tokens"], replies[1]["usage"]["output_tokens"],
                 replies[2]["usage"]["output_tokens"]]
        # Every call's tokens are trained, in order, as many as the program was told it drew.
        masks = [episode.mask, *[s.mask for s in episode.extra_sequences]]
        assert sum(int(np.asarray(m).sum()) for m in masks) == sum(drawn)
        assert json.loads((out / f"{task['id']}-again.json").read_text())["error"]["code"] == "already_posted"


def test_failing_programs_end_only_their_episode(worker, script):
    path, out = script
    agent = tinkerless.external_agent(["bash", str(path)], env={"OUT": str(out)})
    tasks = [{"id": "a", "mode": "no_reward"}, {"id": "b", "mode": "bad_key"}, {"id": "c", "mode": "hang"},
             {"id": "d", "mode": "ok"}]
    episodes = _play(worker, agent, tasks, timeout=4.0)
    assert [e.status for e in episodes] == ["error", "error", "error", "ok"]
    assert "without posting a reward" in episodes[0].error
    assert "exited with status 3" in episodes[1].error and "chat 401" in episodes[1].error
    assert "timed out" in episodes[2].error
    pid = int((out / "c.pid").read_text())
    with pytest.raises(ProcessLookupError):  # the program was killed with its episode
        os.kill(pid, 0)
    assert episodes[3].reward == 0.25


def test_an_external_agent_refuses_a_non_loopback_endpoint():
    import asyncio

    import openai

    agent = tinkerless.external_agent(["true"])
    client = openai.AsyncOpenAI(base_url="http://tinkerless-worker/v1", api_key="k")
    with pytest.raises(tinkerless.errors.UserCodeError, match="loopback"):
        asyncio.run(agent(client, {}))
    with pytest.raises(tinkerless.errors.UserCodeError):
        tinkerless.external_agent([])


TIMED = r"""
set -eu
date +%s.%N > "$OUT/start-$$"
auth="Authorization: Bearer $TINKERLESS_API_KEY"
curl -sS -o /dev/null -H "$auth" -H 'Content-Type: application/json' "$OPENAI_BASE_URL/chat/completions" \
  -d '{"model": "policy", "messages": [{"role": "user", "content": "hi"}]}'
curl -sS -o /dev/null -H "$auth" -H 'Content-Type: application/json' "$ANTHROPIC_BASE_URL/v1/messages" \
  -d '{"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}'
date +%s.%N > "$OUT/end-$$"
curl -sS -o /dev/null -H "$auth" -H 'Content-Type: application/json' "$TINKERLESS_REWARD_URL" -d '{"reward": 1}'
"""


def test_the_capture_endpoints_calls_count_against_the_keys_budget(worker, tmp_path):
    """Through `tinkerless serve` (in-process agents, keys with budgets): a rollout whose agent is an external program
    is a metered call like any other. Its key is charged for the whole rollout, the program's calls through the
    capture endpoint included; a key whose budget is spent is refused (402) before the program starts."""
    import httpx

    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.server.keys import KeyStore
    from tinkerless.storage import ObjectStore
    from tinkerless.wire import decode_message, encode_message, pack_code
    from tinkerless.wire.http import COMPUTE_SECONDS_HEADER
    from tinkerless.wire.messages import ErrorReply, RolloutRequest, RolloutResult

    (tmp_path / "agent.sh").write_text(TIMED)
    out = tmp_path / "out"
    out.mkdir()
    agent = tinkerless.external_agent(["bash", str(tmp_path / "agent.sh")], env={"OUT": str(out)})
    request = encode_message(RolloutRequest(
        policy=BASE_POLICY, tasks=[{"id": "a"}, {"id": "b"}], group_size=1, seed=0, agent=pack_code(agent),
        sampling=SamplingParams(max_tokens=4, temperature=1.0), limits=EpisodeLimits(8, 4096), agent_transport="http"))
    keys = KeyStore(ObjectStore(str(tmp_path / "storage")))
    price = 3600.0  # $ per hour: a second of compute costs $1

    def rollout(key: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/call/rollout", content=request, timeout=120,
                          headers={"Content-Type": "application/msgpack", "Authorization": f"Bearer {key}"})

    def usage(key: str) -> dict:
        return httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}).json()

    with serve_in_thread(create_app(worker, keys=keys, storage=str(tmp_path / "storage"), price_per_hour=price)) as url:
        spent_key = keys.create("lab", budget_usd=0.0)
        refused = rollout(spent_key)
        assert refused.status_code == 402 and decode_message(refused.content).type == "BudgetExceeded"
        assert list(out.iterdir()) == [] and usage(spent_key)["calls"] == 0  # the program never started

        key = keys.create("lab", budget_usd=1000.0)
        answer = rollout(key)
        result = decode_message(answer.content)
        assert answer.status_code == 200 and isinstance(result, RolloutResult), result
        assert [e.status for e in result.episodes] == ["ok", "ok"] and all(e.num_turns == 2 for e in result.episodes)
        charged = float(answer.headers[COMPUTE_SECONDS_HEADER])
        programs = [float((out / f"end-{p.name[6:]}").read_text()) - float(p.read_text()) for p in out.glob("start-*")]
        assert len(programs) == 2 and charged >= max(programs)  # the program's calls are inside the metered call
        after = usage(key)
        assert after["calls"] == 1 and after["spent_usd"] == pytest.approx(charged * price / 3600, abs=1e-3)  # (the header: 6 decimals)

        keys.set_budget(key.split("-")[1], after["spent_usd"])  # now spent: the next rollout never reaches the program
        for path in out.iterdir():
            path.unlink()
        again = rollout(key)
        assert again.status_code == 402 and isinstance(decode_message(again.content), ErrorReply)
        assert list(out.iterdir()) == [] and usage(key)["calls"] == 1
