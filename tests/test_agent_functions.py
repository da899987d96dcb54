"""Agent functions on the worker: real openai clients against the worker's endpoint (the serve router),
recorded token by token, failures dropped like failing envs, and a real training run."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import tinkerless
from tinkerless.functions.hosting.agent_functions import run_agent_episodes
from tinkerless.functions.openai_api.render import render_chat
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of mask == 1."""
    edges = np.diff(np.concatenate(([0], (mask > 0).astype(np.int8), [0])))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def _play(worker, agent, tasks, *, group_size=1, max_tokens=6, timeout=60.0, transport="asgi", max_turns=16):
    return run_agent_episodes(
        worker.engine, worker.tokenizer, agent=agent, policy=BASE_POLICY, tasks=tasks, group_size=group_size,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0), limits=EpisodeLimits(max_turns, 4096),
        seed=3, timeout=timeout, transport=transport,
    )


seen: dict = {}


@tinkerless.agent
async def two_calls(client, task):
    """Call, send the reply back with a tool result, call again; keep what the endpoint answered."""
    first = [{"role": "user", "content": task["question"]}]
    r1 = await client.chat.completions.create(model="policy", messages=first, tools=[CALCULATOR], logprobs=True)
    reply = r1.choices[0].message.model_dump(exclude_none=True)
    second = first + [reply, {"role": "user", "content": "The calculator says 42."}]
    r2 = await client.chat.completions.create(model="policy", messages=second, tools=[CALCULATOR], logprobs=True)
    seen[task["question"]] = (first, second, r1, r2)
    return 1.0


@pytest.mark.parametrize("transport", ["asgi", "http"])
def test_a_reply_sent_back_continues_one_sequence_token_by_token(worker, transport):
    (episode,) = _play(worker, two_calls, [{"question": f"What is 6 * 7? ({transport})"}])
    assert episode.status == "ok", episode.traceback
    first, second, r1, r2 = seen[f"What is 6 * 7? ({transport})"]
    tokenizer = worker.tokenizer
    end_of_turn = set(worker.chat.eos_token_ids)
    assert episode.extra_sequences == [] and episode.num_turns == 2
    (a, b), (c, d) = _runs(episode.mask)
    prompt1 = render_chat(tokenizer, first, [CALCULATOR])
    assert episode.tokens[:a].tolist() == prompt1 and episode.prompt_length == a == len(prompt1)
    # The sampled runs are exactly what each call drew: usage counts them, logprobs are the sampler's.
    assert b - a == r1.usage.completion_tokens and d - c == r2.usage.completion_tokens and d == len(episode.tokens)
    for (start, _), response in (((a, b), r1), ((c, d), r2)):
        drawn = [t.logprob for t in response.choices[0].logprobs.content]
        assert episode.sampler_logprobs[start : start + len(drawn)].tolist() == pytest.approx(drawn, abs=1e-6)
    assert episode.sampler_logprobs[episode.mask == 0].tolist() == [0.0] * int((episode.mask == 0).sum())
    # Between the two sampled runs: the template's glue and the tool result as the router renders them
    # (mask 0), and the reply itself is the sampled ids, not its re-tokenized text.
    prompt2 = render_chat(tokenizer, second, [CALCULATOR])
    closed = episode.tokens[b - 1] in end_of_turn
    reply_end = next(i for i in range(len(prompt1), len(prompt2)) if prompt2[i] in end_of_turn)
    glue = prompt2[reply_end + 1 :] if closed else prompt2[reply_end:]
    assert episode.tokens[b:c].tolist() == glue
    assert episode.mask[b:c].tolist() == [0.0] * len(glue)


@tinkerless.agent
async def summarizing(client, task):
    """The second call starts from a rewritten context: a sequence of its own."""
    r1 = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    fresh = [{"role": "system", "content": "Summary so far: greeted."}, {"role": "user", "content": "go on"}]
    r2 = await client.chat.completions.create(model="policy", messages=fresh, logprobs=True)
    seen["summarizing"] = (fresh, r1, r2)
    return tinkerless.AgentResult(reward=0.5, metrics={"calls": 2})


def test_a_rewritten_context_becomes_a_second_sequence_with_the_same_episode(worker):
    (episode,) = _play(worker, summarizing, [{}])
    assert episode.status == "ok", episode.traceback
    fresh, r1, r2 = seen["summarizing"]
    assert episode.reward == 0.5 and episode.info["agent_metrics"] == {"calls": 2.0}
    ((a, b),) = _runs(episode.mask)
    assert episode.tokens[:a].tolist() == render_chat(worker.tokenizer, [{"role": "user", "content": "hi"}])
    assert b == len(episode.tokens) and b - a == r1.usage.completion_tokens
    (extra,) = episode.extra_sequences
    prompt = render_chat(worker.tokenizer, fresh)
    assert extra.tokens[: len(prompt)].tolist() == prompt
    assert extra.mask.tolist() == [0.0] * len(prompt) + [1.0] * r2.usage.completion_tokens
    drawn = [t.logprob for t in r2.choices[0].logprobs.content]
    assert extra.sampler_logprobs[len(prompt) : len(prompt) + len(drawn)].tolist() == pytest.approx(drawn, abs=1e-6)


@tinkerless.agent
async def misbehaving(client, task):
    kind = task["kind"]
    if kind == "ok":
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1
    if kind == "streams":  # SSE through the in-process transport: recorded like any call
        stream = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                      stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        return 2.0 + 0 * len(text)
    if kind == "raises":
        raise RuntimeError("the agent broke")
    if kind == "slow":
        await asyncio.sleep(120)
    if kind == "text":
        return "1.0"
    if kind == "none":
        return None
    if kind == "wrong_model":
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    if kind == "n2":
        await client.chat.completions.create(model="policy", n=2, messages=[{"role": "user", "content": "x"}])
    if kind == "too_many_calls":
        for _ in range(3):
            await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    if kind == "nan":
        return float("nan")
    return 0.0


def test_failing_agents_are_dropped_with_their_traceback_and_the_rest_go_on(worker):
    kinds = ["ok", "streams", "raises", "slow", "text", "none", "wrong_model", "n2", "too_many_calls", "nan"]
    episodes = _play(worker, misbehaving, [{"kind": k} for k in kinds], timeout=10.0, max_turns=2)
    by_kind = dict(zip(kinds, episodes))
    assert by_kind["ok"].status == "ok" and by_kind["ok"].reward == 1.0 and by_kind["ok"].mask.sum() > 0
    assert by_kind["streams"].status == "ok", by_kind["streams"].error
    assert by_kind["streams"].reward == 2.0 and by_kind["streams"].mask.sum() > 0
    for kind in kinds[2:]:
        episode = by_kind[kind]
        assert episode.status == "error" and np.isnan(episode.reward), kind
        assert episode.error.startswith("misbehaving") and episode.traceback, kind
    assert "RuntimeError: the agent broke" in by_kind["raises"].error
    assert "in misbehaving" in by_kind["raises"].traceback
    assert "timed out after agent_timeout=10" in by_kind["slow"].error
    assert "not a number" in by_kind["text"].error and "returned None" in by_kind["none"].error
    assert "NotFoundError" in by_kind["wrong_model"].error and "model='policy'" in by_kind["wrong_model"].error
    assert "BadRequestError" in by_kind["n2"].error and "n=2" in by_kind["n2"].error
    assert "max_turns=2" in by_kind["too_many_calls"].error
    assert "not a finite number" in by_kind["nan"].error


@tinkerless.agent
async def one_call(client, task):
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": task["q"]}])
    return float(len(r.choices[0].message.content or "") % 3)


def test_concurrent_copies_are_batched_into_one_generation(worker):
    batcher = worker.engine.batcher
    before = batcher.widest
    batcher.widest = 0
    try:
        episodes = _play(worker, one_call, [{"q": "a"}, {"q": "b"}], group_size=8, max_tokens=8)
        assert all(e.status == "ok" for e in episodes) and len(episodes) == 16
        # Every copy waits on the model at once: their 16 calls are decoded as one batch, of every row whose
        # first token (drawn from the prefill) did not end it already.
        decoding = sum(int(e.mask.sum()) > 1 for e in episodes)
        assert decoding >= 12 and batcher.widest == decoding, f"{batcher.widest} of {decoding} rows decoded together"
    finally:
        batcher.widest = max(before, batcher.widest)


def test_the_decorator_checks_the_agents_shape():
    with pytest.raises(tinkerless.errors.UserCodeError, match="async function"):
        tinkerless.agent(lambda client, task: 1.0)

    async def one_argument(client):
        return 1.0

    with pytest.raises(tinkerless.errors.UserCodeError, match=r"\(client, task\)"):
        tinkerless.agent(one_argument)


def test_config_refuses_an_agent_with_an_env_or_reward_and_bad_agent_settings():
    base = dict(agent=one_call, tasks=[{"q": "a"}])
    tinkerless.TrainConfig(**base).validate()
    with pytest.raises(tinkerless.errors.ConfigError, match="replaces env= and reward="):
        tinkerless.TrainConfig(**base, reward=lambda c, t: 1.0).validate()
    with pytest.raises(tinkerless.errors.ConfigError, match="agent_timeout"):
        tinkerless.TrainConfig(**base, agent_timeout=0).validate()
    with pytest.raises(tinkerless.errors.ConfigError, match="agent_transport"):
        tinkerless.TrainConfig(**base, agent_transport="carrier-pigeon").validate()


def test_a_multi_tenant_worker_runs_agent_rollouts_in_the_tenants_sandbox(worker):
    """No longer refused (issue #15): the copies run in the tenant's host; tests/test_agent_sandbox_attacks.py has more."""
    from tinkerless.functions.hosting.user_code import UserCodeHosts, tenant_scope
    from tinkerless.wire import decode_message, encode_message, pack_code
    from tinkerless.wire.messages import RolloutRequest, RolloutResult

    request = RolloutRequest(policy=BASE_POLICY, tasks=[{"q": "a"}], group_size=2, sampling=SamplingParams(max_tokens=4),
                             limits=EpisodeLimits(), seed=0, agent=pack_code(one_call))
    worker.user_code_hosts = hosts = UserCodeHosts()  # a shared server: tenant code lives in sandboxes
    try:
        with tenant_scope("dave"):
            reply = decode_message(worker.handle("rollout", encode_message(request)))
    finally:
        worker.user_code_hosts = None
        hosts.close()
    assert isinstance(reply, RolloutResult) and [e.status for e in reply.episodes] == ["ok", "ok"]
    assert reply.stats["agent_requests"] == 2.0  # both copies called the model over their channel


@tinkerless.agent
async def summarizing_varied(client, task):
    """Two sequences per episode (a rewritten context) and rewards that differ within a group."""
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "summary: hi"}])
    text = r.choices[0].message.content or ""
    return tinkerless.AgentResult(reward=float(sum(map(ord, text)) % 7), metrics={"calls": 2})


def test_train_an_agent_end_to_end_with_every_sequence_of_an_episode_trained(tiny_model, tmp_path):
    result = tinkerless.train(
        model=tiny_model, agent=summarizing_varied, tasks=[{"i": 0}, {"i": 1}], steps=2, batch_size=2, group_size=3,
        max_tokens=4, storage=str(tmp_path), progress=False, learning_rate=1e-3,
    )
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert all(m["episodes_error"] == 0 and m["agent/calls"] == 2.0 for m in result.metrics)
    # Both sequences of each episode with a non-zero advantage are trained: always an even count.
    trained = [m["trained_sequences"] for m in result.metrics]
    assert all(t % 2 == 0 for t in trained) and sum(trained) > 0, trained
    assert result.metrics[-1]["policy_version"] >= 1


def test_a_tool_call_sent_back_re_serialized_is_spliced_back_as_the_sampled_ids(worker):
    """The model writes a tool call its own way; the router parses it into `tool_calls` and re-renders it
    with its own JSON spacing. The next prompt gets the sampled ids back, not the re-rendering."""
    from tinkerless.functions.hosting.agent_functions import same_reply_checker
    from tinkerless.functions.rollout.recording import EpisodeRecorder
    from tinkerless.functions.openai_api.render import parse_tool_calls

    tokenizer, end = worker.tokenizer, worker.chat.eos_token_ids[0]
    first = [{"role": "user", "content": "What is 3 * 4?"}]
    prompt1 = render_chat(tokenizer, first, [CALCULATOR])
    written = 'Let me compute.\n<tool_call>{"name":"calculator","arguments":{"expression":"3*4"}}</tool_call>'
    sampled = tokenizer.encode(written, add_special_tokens=False) + [end]
    content, calls = parse_tool_calls(written)
    reply = {"role": "assistant", "content": content, "tool_calls": calls}
    second = first + [reply, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12"}]
    rendered = render_chat(tokenizer, second, [CALCULATOR])
    assert rendered[: len(prompt1) + len(sampled)] != prompt1 + sampled  # re-serialized: not an extension as is

    recorder = EpisodeRecorder(same_reply_checker(tokenizer))
    recorder.record(prompt1, sampled, [-0.5] * len(sampled), [end])
    prompt2 = recorder.prompt_for(rendered)
    assert prompt2[: len(prompt1) + len(sampled)] == prompt1 + sampled
    reply_end = next(i for i in range(len(prompt1), len(rendered)) if rendered[i] == end)
    assert prompt2[len(prompt1) + len(sampled) :] == rendered[reply_end + 1 :]  # the tool result's glue, unchanged
    recorder.record(prompt2, [7, end], [-0.1, -0.2], [end])
    (sequence,) = recorder.sequences()
    assert sequence.mask == [0.0] * len(prompt1) + [1.0] * len(sampled) + [0.0] * (len(rendered) - reply_end - 1) + [1.0, 1.0]

    # The same reply with a different argument is an edited reply: not spliced, a new sequence.
    edited = dict(reply, tool_calls=[{**calls[0], "function": {"name": "calculator", "arguments": '{"expression": "3*5"}'}}])
    other = render_chat(tokenizer, first + [edited, second[-1]], [CALCULATOR])
    fresh = EpisodeRecorder(same_reply_checker(tokenizer))
    fresh.record(prompt1, sampled, [-0.5] * len(sampled), [end])
    assert fresh.prompt_for(other) == other
