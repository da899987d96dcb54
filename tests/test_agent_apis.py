"""Agent functions that call the policy through any API: Chat Completions, `client.responses` and
`tinkerless.anthropic_client(client)` mixed in one episode (in process, over loopback HTTP and in a tenant's
sandbox), and an OpenAI Agents SDK agent with its default (Responses) model and two tools, recorded token for token.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import tinkerless
from tinkerless.functions.hosting.agent_functions import run_agent_episodes
from tinkerless.functions.sampling.engine import Generation
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams

pytestmark = pytest.mark.timeout(300)


def _play(engine, tokenizer, agent, tasks, *, max_tokens=6, transport="asgi"):
    return run_agent_episodes(
        engine, tokenizer, agent=agent, policy=BASE_POLICY, tasks=tasks, group_size=1,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0), limits=EpisodeLimits(16, 4096),
        seed=5, timeout=60.0, transport=transport,
    )


def _sampled_runs(episode) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of every run of mask 1, over all the episode's sequences, in order."""
    runs = []
    for tokens, mask, logprobs in [(episode.tokens, episode.mask, episode.sampler_logprobs),
                                   *[(s.tokens, s.mask, s.sampler_logprobs) for s in episode.extra_sequences]]:
        edges = np.diff(np.concatenate(([0], (mask > 0).astype(np.int8), [0])))
        for start, end in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            runs.append((tokens[start:end].tolist(), logprobs[start:end].tolist()))
    return runs


seen: dict = {}


@tinkerless.agent
async def three_apis(client, task):
    """One conversation through Chat Completions, Anthropic Messages (streamed) and Responses, each call sending
    the earlier replies back."""
    claude = tinkerless.anthropic_client(client)
    ask = [{"role": "user", "content": task["q"]}]
    r1 = await client.chat.completions.create(model="policy", messages=ask, logprobs=True)
    t1 = r1.choices[0].message.content or ""
    async with claude.messages.stream(model="policy", max_tokens=6, messages=[
            *ask, {"role": "assistant", "content": t1}, {"role": "user", "content": "more"}]) as stream:
        r2 = await stream.get_final_message()
    t2 = "".join(block.text for block in r2.content if block.type == "text")
    r3 = await client.responses.create(model="policy", input=[
        *ask, {"role": "assistant", "content": t1}, {"role": "user", "content": "more"},
        {"role": "assistant", "content": t2}, {"role": "user", "content": "last"}])
    r4 = await client.responses.create(model="policy", input="and?", previous_response_id=r3.id)
    seen[task["q"]] = (r1, r2, r3, r4)
    return 1.0


@pytest.mark.parametrize("transport", ["asgi", "http"])
def test_one_episode_mixes_chat_completions_messages_and_responses(worker, transport):
    q = f"Hello ({transport})"
    (episode,) = _play(worker.engine, worker.tokenizer, three_apis, [{"q": q}], transport=transport)
    assert episode.status == "ok", episode.traceback
    r1, r2, r3, r4 = seen[q]
    assert episode.num_turns == 4
    runs = _sampled_runs(episode)
    # Every call's sampled tokens are trained, each run exactly as long as the API's usage says it drew.
    assert [len(tokens) for tokens, _ in runs] == [r1.usage.completion_tokens, r2.usage.output_tokens,
                                                   r3.usage.output_tokens, r4.usage.output_tokens]
    assert runs[0][1] == pytest.approx([t.logprob for t in r1.choices[0].logprobs.content]
                                       + runs[0][1][len(r1.choices[0].logprobs.content):], abs=1e-6)
    # Replies sent back through another API still continue one sequence: the sampled ids, handed back.
    assert episode.extra_sequences == [] and episode.info["sequences"] == 1


def test_a_tenants_sandboxed_agent_may_use_the_anthropic_client(worker):
    from tinkerless.functions.hosting.user_code import UserCodeHosts, tenant_scope
    from tinkerless.wire import decode_message, encode_message, pack_code
    from tinkerless.wire.messages import RolloutRequest, RolloutResult

    request = RolloutRequest(policy=BASE_POLICY, tasks=[{"q": "a"}], group_size=2, sampling=SamplingParams(max_tokens=4),
                             limits=EpisodeLimits(16, 4096), seed=0, agent=pack_code(three_apis))
    worker.user_code_hosts = hosts = UserCodeHosts()
    try:
        with tenant_scope("erin"):
            reply = decode_message(worker.handle("rollout", encode_message(request)))
    finally:
        worker.user_code_hosts = None
        hosts.close()
    assert isinstance(reply, RolloutResult) and [e.status for e in reply.episodes] == ["ok", "ok"], \
        [e.traceback for e in reply.episodes]
    assert [e.num_turns for e in reply.episodes] == [4, 4] and reply.stats["agent_requests"] == 8.0


class ScriptedEngine:
    """An engine whose model writes what `script(prompt text)` says (then its end of turn), with made-up log-probs:
    a random model never calls a tool, and the Agents SDK's tool loop is what is tested here."""

    name = "scripted"

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script = tokenizer, script
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.drawn: list[list[int]] = []

    def generate(self, prompts, sampling, *, policy=None, seed=None, row_seeds=None, **_):
        generations = []
        for prompt in prompts:
            ids = self.tokenizer.encode(self.script(self.tokenizer.decode(prompt)), add_special_tokens=False)
            ids = ids[: sampling.max_tokens - 1] + [self.end]
            self.drawn.append(ids)
            generations.append(Generation(ids, [-0.5 - 0.001 * i for i in range(len(ids))], "stop"))
        return generations


def agents_sdk_script(prompt: str) -> str:
    """Add 40 and 2, then multiply by 1, then answer."""
    conversation = prompt[prompt.index("<|im_start|>user"):]  # (the system message shows an example response)
    results = re.findall(r"<tool_response>(.*?)</tool_response>", conversation, re.S)
    if not results:
        return 'I will add. <tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>'
    if len(results) == 1:
        return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {results[0].strip()}, "b": 1}}}}</tool_call>'
    return f"The answer is {results[1].strip()}."


@tinkerless.agent
async def agents_sdk_calculator(client, task):
    from agents import Agent, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)  # traces would go to OpenAI's servers

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @function_tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    agent = Agent(name="calculator", instructions="Use the tools.", tools=[add, multiply], model="policy")
    result = await Runner.run(agent, task["q"], run_config=RunConfig(model_provider=OpenAIProvider(openai_client=client)))
    seen["agents_sdk"] = result
    return 1.0 if result.final_output == "The answer is 42." else 0.0


def test_an_agents_sdk_agent_with_two_tools_is_recorded_token_for_token(worker):
    engine = ScriptedEngine(worker.tokenizer, agents_sdk_script)
    (episode,) = _play(engine, worker.tokenizer, agents_sdk_calculator, [{"q": "What is 40 + 2?"}], max_tokens=200)
    assert episode.status == "ok", episode.traceback
    assert episode.reward == 1.0 and episode.num_turns == 3 == len(engine.drawn)
    result = seen["agents_sdk"]
    calls = [item.raw_item.name for item in result.new_items if item.type == "tool_call_item"]
    assert calls == ["add", "multiply"]
    # The three replies, exactly as drawn, are the trained tokens with their log-probs; the SDK's re-sent
    # function_call items were spliced back to the sampled ids, so the episode is one sequence.
    runs = _sampled_runs(episode)
    assert [tokens for tokens, _ in runs] == engine.drawn
    assert all(lp == pytest.approx([-0.5 - 0.001 * i for i in range(len(t))]) for t, lp in runs)
    assert episode.extra_sequences == []


# ChatML whose assistant turns are re-rendered otherwise than the model wrote them: whitespace trimmed, and an
# earlier turn's <think> part dropped (as reasoning models' templates do).
DRIFTING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{{ (m.content.split('</think>')[-1] if '</think>' in m.content else m.content) | trim }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@tinkerless.agent
async def rebuilds_history(client, task):
    """Sends its whole history back, as text, every call."""
    messages = [{"role": "user", "content": "hi"}]
    for follow_up in ("and?", "bye"):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    await client.chat.completions.create(model="policy", messages=messages)
    return 1.0


def test_a_template_that_re_renders_earlier_turns_trains_the_sampled_tokens_and_reports_the_drift(worker):
    import copy

    tokenizer = copy.deepcopy(worker.tokenizer)
    tokenizer.chat_template = DRIFTING_TEMPLATE
    replies = iter(["  Hello there.  ", "<think>secret plan</think>Fine.", "Bye."])
    engine = ScriptedEngine(tokenizer, lambda prompt: next(replies))
    (episode,) = _play(engine, tokenizer, rebuilds_history, [{}], max_tokens=200)
    assert episode.status == "ok", episode.error
    # Call 2 re-rendered reply 1 trimmed (it says the same: its sampled ids are handed back); call 3 re-rendered
    # reply 2 without its thinking (it does not say the same: a new sequence). Two drift turns.
    assert episode.info["render_drift_turns"] == 2 and episode.info["sequences"] == 2
    runs = _sampled_runs(episode)
    assert [tokens for tokens, _ in runs] == engine.drawn  # every reply trains exactly as sampled, once
    first_end = len(episode.tokens)
    assert tokenizer.decode(episode.tokens[:first_end]).count("  Hello there.  ") == 1
    second = episode.extra_sequences[0]
    assert "secret plan" not in tokenizer.decode(second.tokens)  # what the model was given the third time
    assert "Fine." in tokenizer.decode(second.tokens[second.mask == 0])


def test_render_drift_is_a_step_metric(tiny_model, tmp_path):
    from tinkerless.sdk.run.step_metrics import agent_result_metrics
    from tinkerless.wire.messages import Episode

    def episode(drift, status="ok"):
        return Episode(task_index=0, tokens=np.zeros(1, np.int32), mask=np.zeros(1, np.float32),
                       sampler_logprobs=np.zeros(1, np.float32), prompt_length=1, reward=0.0, status=status,
                       info={"render_drift_turns": drift})

    assert agent_result_metrics([episode(2), episode(0), episode(1, "error")])["render_drift_turns"] == 3.0
    assert "render_drift_turns" not in agent_result_metrics([])


PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
       "required": ["kind", "ok"], "additionalProperties": False}


@tinkerless.agent
async def structured(client, task):
    import json

    reply = await client.responses.create(model="policy", input="A pet?", text={
        "format": {"type": "json_schema", "name": "pet", "schema": PET}})
    pet = json.loads(reply.output_text)  # always parses: constrained decoding
    return 1.0 if pet["kind"] == "cat" else 0.0


def test_structured_outputs_in_a_rollout_record_the_masked_log_probs(worker):
    episodes = run_agent_episodes(
        worker.engine, worker.tokenizer, agent=structured, policy=BASE_POLICY, tasks=[{}], group_size=4,
        sampling=SamplingParams(max_tokens=64, temperature=1.0), limits=EpisodeLimits(4, 4096), seed=11,
        timeout=60.0)
    assert [e.status for e in episodes] == ["ok"] * 4, [e.error for e in episodes]
    for episode in episodes:
        ((tokens, logprobs),) = _sampled_runs(episode)
        assert worker.tokenizer.decode(tokens[:1]) == "{" and logprobs[0] == 0.0  # forced: drawn with probability 1
        assert all(lp <= 0.0 for lp in logprobs)
