"""Drive `tinkerless serve`'s token route with verifiers 0.4 itself (run by verifiers_check.sh).

Runs in .venv-verifiers (verifiers pins openai and mcp versions the tinkerless venv does not take).

Part 1, the client alone: a two-turn conversation through `verifiers.v1.clients.train.TrainClient.get_response`,
the call verifiers' interception server makes for every model turn. It renders the chat with the model's
template (`renderers`), posts to `/inference/v1/generate` and reads back token ids and log-probs.

Part 2, whole episodes with verifiers' own loop, as prime-rl runs them: an environment defined below the way
verifiers' tasksets are written (typed `TaskData`, a `Task` whose `@vf.reward` is the rubric, a `Taskset` whose
`load()` yields the tasks, an `Env` whose `run()` plays the user), served by verifiers' env server (`serve_env`, in
a process of its own: the env, its interception server, the `null` harness - verifiers' tool-less chat program,
prepared with `uv` and run in the `subprocess` runtime - and `TrainClient` as the model client) and driven by its
`EnvClient`, which streams each episode back over the msgpack wire as a `WireEpisode`. Half the tasks are one
turn, half two (the env asks a follow-up question, as TextArena's env steps its game). The model client reaches
tinkerless through a recording proxy here, and every episode is checked against the route replies its turns got
(matched by the `X-Session-ID` header, the trace id):
  - each branch's `token_ids` are the last call's prompt ids plus its sampled ids, and every earlier call's
    prompt plus reply is a prefix of it: the turns' tokens are exactly what tinkerless sampled;
  - `sampled_mask` is True on exactly the sampled ids, `logprobs` equal the route's there and are 0 elsewhere;
  - the first prompt is the chat template's rendering of the task's messages; a later prompt is reported
    beside the template's rendering of the whole conversation (verifiers extends the previous tokens instead);
  - the assistant messages are the decoded sampled ids, and the rubric's reward equals a recomputation of the
    task's rule on the decoded reply.
One more task's prompt is longer than the card's `max_model_len`: verifiers must refuse it before sending it.

    python scripts/verifiers_check.py BASE_URL MODEL_DIR [NUM_TASKS]   # $TINKERLESS_API_KEY holds the key; 6 tasks
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import re
import sys
from collections import defaultdict

import aiohttp
import verifiers.v1 as vf
from aiohttp import web
from transformers import AutoTokenizer
from verifiers.v1.clients.client import SESSION_ID_HEADER
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.dialects.chat import ChatDialect
from verifiers.v1.episode import WireEpisode
from verifiers.v1.serve import EnvClient, env_config_data, serve_env

TASKSET_ID = "tinkerless_sums"  # the module name verifiers' loader imports this taskset by
# Registered at import, so that the env server's spawned process (which imports this script) finds it too.
sys.modules.setdefault(TASKSET_ID, sys.modules[__name__])


# --- the environment, as a verifiers taskset package would define it -----------------------------------------

def last_number(text: str) -> int | None:
    """The reply's answer: its last number (a small model writes "6 + 7 = 13", "The answer is 13.")."""
    numbers = re.findall(r"-?\d+", text)
    return int(numbers[-1]) if numbers else None


def expected_answer(data) -> int:
    """The last turn's answer: a + b, plus the follow-up's number when there is one (works on `WireTaskData`)."""
    return data.answer + (data.follow_up or 0)


class SumsData(vf.TaskData):
    answer: int
    """a + b, the first turn's answer."""
    follow_up: int | None = None
    """When set, the env asks the model to add it to its answer in a second turn."""

    @property
    def expected(self) -> int:
        return expected_answer(self)


class SumsTask(vf.Task[SumsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply) == self.data.expected)


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 4
    seed: int = 0
    overlong_words: int = 0
    """When set, one more task whose question follows that many words: a prompt over the model's context."""


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.num_tasks):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            yield SumsTask(SumsData(name=f"sum#{i}", prompt=f"What is {a} + {b}? Answer with the number only.",
                                    answer=a + b, follow_up=rng.randint(1, 9) if i % 2 else None), self.config.task)
        if self.config.overlong_words:
            yield SumsTask(SumsData(name="overlong", prompt="word " * self.config.overlong_words + "What is 1 + 1?",
                                    answer=2), self.config.task)


class SumsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class SumsEnv(vf.Env[SumsEnvConfig]):
    async def run(self, task: SumsTask, agents: vf.Agents) -> None:
        if task.data.follow_up is None:
            await agents.agent.run(task)  # one segment: the program answers the prompt and exits
            return
        async with agents.agent.interaction(task) as interaction:  # the env is the user
            first = await interaction.turn()
            if not first.terminated:
                await interaction.turn(f"Now add {task.data.follow_up} to your answer. Answer with the number only.")


__all__ = ["SumsEnv", "SumsTaskset"]


# --- recording what the route answered ------------------------------------------------------------------------

ROUTE_CALLS: dict[str | None, list[tuple[dict, dict]]] = defaultdict(list)


async def recording_proxy(upstream: str) -> tuple[web.AppRunner, str]:
    """A loopback proxy to `upstream` that keeps each `/inference/v1/generate` request and reply, by session id:
    what the route answered, seen outside verifiers. Returns the runner and the proxy's `/v1` base URL."""
    session = aiohttp.ClientSession()

    async def forward(request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with session.request(request.method, upstream + request.rel_url.path_qs, data=body,
                                   headers=headers) as reply:
            data = await reply.read()
            if request.path == "/inference/v1/generate" and reply.status == 200:
                ROUTE_CALLS[request.headers.get(SESSION_ID_HEADER)].append((json.loads(body), json.loads(data)))
            return web.Response(body=data, status=reply.status, content_type=reply.content_type)

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/{path:.*}", forward)
    app.on_cleanup.append(lambda _: session.close())
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


# --- part 1: the client alone -----------------------------------------------------------------------------------

async def client_turns(client: TrainClient, served: str, tokenizer) -> None:
    messages = [{"role": "user", "content": "Name a colour. Answer with one word."}]
    for turn in range(2):
        response = await client.get_response(ChatDialect(), {"model": served, "messages": messages},
                                             vf.SamplingConfig(max_tokens=12, temperature=1.0))
        tokens = response.tokens
        assert tokens.completion_ids and len(tokens.completion_ids) == len(tokens.completion_logprobs), tokens
        assert all(math.isfinite(lp) and lp <= 0 for lp in tokens.completion_logprobs), tokens.completion_logprobs
        assert list(tokens.prompt_ids) == template_ids(tokenizer, messages), "prompt ids are not the chat template's"
        text = tokenizer.decode(tokens.completion_ids, skip_special_tokens=True)
        assert (response.message.content or "").strip() == text.strip(), (response.message.content, text)
        print(f"  turn {turn}: {len(tokens.prompt_ids)} prompt ids, {len(tokens.completion_ids)} sampled "
              f"({response.finish_reason}): {text!r}")
        messages = messages + [{"role": "assistant", "content": response.message.content or ""},
                               {"role": "user", "content": "Another one."}]


def template_ids(tokenizer, messages: list[dict]) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


# --- part 2: whole episodes -------------------------------------------------------------------------------------

async def play_episodes(client_config: vf.TrainClientConfig, served: str, num_tasks: int,
                        overlong_words: int) -> list[WireEpisode]:
    config = vf.resolve_env_config({
        "taskset": {"id": TASKSET_ID, "num_tasks": num_tasks, "overlong_words": overlong_words},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": 4},
    })
    assert vf.environment_class(TASKSET_ID) is SumsEnv
    # verifiers' env server in a process of its own, as prime-rl starts it; two episodes at a time on a small box.
    spawn = multiprocessing.get_context("spawn")
    addresses = spawn.Queue()
    server = spawn.Process(target=serve_env, daemon=True, kwargs={
        "max_workers": 1, "address": "tcp://127.0.0.1:0", "address_queue": addresses,
        "config_data": env_config_data(config), "max_concurrent": 2})
    server.start()
    client = EnvClient(await asyncio.to_thread(addresses.get, True, 180))
    sampling = vf.SamplingConfig(max_tokens=24, temperature=0.7, seed=1234)
    try:
        tasks = list(vf.load_taskset(config.taskset))
        return await asyncio.gather(*(client.run(client_config, served, sampling, task.data.model_dump(mode="json"))
                                      for task in tasks))
    finally:
        await client.close()
        server.terminate()  # SIGTERM: the server tears its env down (interception, harness processes)
        await asyncio.to_thread(server.join, 30)
        if server.is_alive():
            server.kill()


def check_trace(trace, tokenizer) -> dict:
    """Check one trace against the route replies recorded for its session; return its summary row."""
    data = trace.task.data
    assert trace.ok, f"{data.name}: the episode failed: {[e.message for e in trace.errors]}"
    calls = ROUTE_CALLS.get(trace.id, [])
    if data.name == "overlong":
        return check_overlong(trace, calls)
    assistant = [n for n in trace.nodes if n.sampled]
    assert calls and len(calls) == len(assistant) == trace.num_turns, (data.name, len(calls), len(assistant))
    branches = trace.branches
    assert len(branches) == 1, f"{data.name}: {len(branches)} branches for a linear conversation"
    branch = branches[0]
    ids, mask, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
    assert len(ids) == len(mask) == len(logprobs)
    expected_mask, expected_logprobs = [False] * len(ids), [0.0] * len(ids)
    for request, reply in calls:
        prompt, choice = reply["prompt_token_ids"], reply["choices"][0]
        sampled = choice["token_ids"]
        assert request["token_ids"] == prompt, "the route's prompt_token_ids are not the request's"
        assert ids[:len(prompt) + len(sampled)] == prompt + sampled, f"{data.name}: a turn's tokens are not a prefix"
        for i, (token, entry) in enumerate(zip(sampled, choice["logprobs"]["content"]), start=len(prompt)):
            assert entry["token"] == f"token_id:{token}"
            expected_mask[i], expected_logprobs[i] = True, entry["logprob"]
    last_prompt, last_choice = calls[-1][1]["prompt_token_ids"], calls[-1][1]["choices"][0]
    assert ids == last_prompt + last_choice["token_ids"], f"{data.name}: branch tokens != last prompt + reply"
    assert mask == expected_mask, f"{data.name}: sampled_mask is not exactly the sampled positions"
    assert logprobs == expected_logprobs, f"{data.name}: logprobs are not the route's"
    # The messages: every assistant message is its sampled ids decoded.
    for node, (_, reply) in zip(assistant, calls):
        text = tokenizer.decode(reply["choices"][0]["token_ids"], skip_special_tokens=True)
        assert (node.message.content or "").strip() == text.strip(), (node.message.content, text)
    # The prompts against the chat template: the first must be its rendering; later ones are reported.
    messages = [m.model_dump(mode="json", include={"role", "content"}) for m in branch.messages]
    starts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    first_prompt = calls[0][1]["prompt_token_ids"]
    assert first_prompt == template_ids(tokenizer, messages[:starts[0]]), f"{data.name}: first prompt != template"
    later_equal = [calls[k][1]["prompt_token_ids"] == template_ids(tokenizer, messages[:start])
                   for k, start in enumerate(starts) if k > 0]
    # The rubric: verifiers' reward against the task's rule on the decoded reply.
    reply_text = tokenizer.decode(last_choice["token_ids"], skip_special_tokens=True)
    own = float(last_number(reply_text) == expected_answer(data))
    reward = trace.rewards["correct"]
    assert reward is not None and reward.score == own, (data.name, reward, own, reply_text)
    return {"task": data.name, "turns": len(calls), "prompt": [len(c[1]["prompt_token_ids"]) for c in calls],
            "sampled": [len(c[1]["choices"][0]["token_ids"]) for c in calls],
            "finish": [c[1]["choices"][0]["finish_reason"] for c in calls], "reply": reply_text.strip(),
            "expected": expected_answer(data), "reward": reward.score, "template_later": later_equal,
            "trained": sum(mask), "tokens": len(ids)}


def check_overlong(trace, calls: list) -> dict:
    """A prompt over the card's max_model_len: verifiers' training client refuses it before sending (renderers'
    pre-flight), the call records the overflow in words its compaction recognizes, and the rubric scores 0."""
    errors = [call.error.message for call in trace.calls if call.error is not None]
    assert not calls, f"an overlong prompt reached the route: {len(calls)} calls"
    assert errors and "maximum context length" in errors[0], (errors, trace.errors)
    reward = trace.rewards["correct"]
    assert reward is not None and reward.score == 0.0, reward
    return {"task": "overlong", "turns": 0, "refused": errors[0], "reward": 0.0}


async def main(base_url: str, model_dir: str, num_tasks: int) -> None:
    proxy, proxy_url = await recording_proxy(base_url.rstrip("/").removesuffix("/v1"))
    client_config = vf.TrainClientConfig(base_url=proxy_url, api_key_var="TINKERLESS_API_KEY",
                                         renderer_model_name=model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    client = TrainClient(client_config)
    try:
        card = (await client.client.models.list()).data[0]
        served = card.id  # the base model's name on the server
        # renderers' pre-flight (run by TrainClient each turn) and verifiers' compaction read vLLM's max_model_len.
        longest = (card.model_extra or {}).get("max_model_len")
        assert isinstance(longest, int) and longest > 0, f"the model card has no max_model_len: {card}"
        print(f"model {served!r}, max_model_len {longest}")
        print("part 1: verifiers' TrainClient.get_response, two turns")
        await client_turns(client, served, tokenizer)
    finally:
        await client.close()
    print(f"part 2: {num_tasks} episodes of {TASKSET_ID}, and one over the context, through verifiers' env server "
          f"(null harness, subprocess runtime, TrainClient)")
    try:
        episodes = await play_episodes(client_config, served, num_tasks, overlong_words=longest + 100)
    finally:
        await proxy.cleanup()
    failed = [(e.task.data.name, [error.message for error in e.errors]) for e in episodes if not e.ok]
    assert not failed, f"episodes failed: {failed}"
    rows = [check_trace(trace, tokenizer) for episode in episodes for trace in episode.traces]
    assert len(rows) == num_tasks + 1, f"{len(rows)} traces for {num_tasks + 1} tasks"
    overlong = next(row for row in rows if row["task"] == "overlong")
    rows.remove(overlong)
    for row in rows:
        later = "" if row["turns"] == 1 else f", turn-2 prompt == template of the conversation: {row['template_later']}"
        print(f"  {row['task']}: {row['turns']} turn(s), prompt ids {row['prompt']}, sampled {row['sampled']} "
              f"{row['finish']}, {row['trained']}/{row['tokens']} tokens trained; reply {row['reply']!r} "
              f"(expected {row['expected']}) reward {row['reward']}{later}")
    print(f"  overlong ({longest + 100} words): refused before sending, {overlong['refused']!r}, reward 0.0")
    print(f"verifiers episodes: ok ({len(rows)} traces: tokens, masks and log-probs are the route's, "
          f"rewards by the rubric, mean reward {sum(r['reward'] for r in rows) / len(rows):.2f})")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6))
