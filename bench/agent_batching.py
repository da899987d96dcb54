"""Agent functions: 32 concurrent agents against the rollout worker's OpenAI endpoint, batched vs one at a time.

Each agent makes two chat-completion calls through a real `openai.AsyncOpenAI` client (the second sends
the first reply back with a user message, as a tool-using agent does) over the in-process ASGI
transport, the default. "batched": the 32 copies run as one rollout, so their calls reach the engine
at the same time and the continuous batcher decodes them together. "one at a time": the same agents
as rollouts of one copy each, one after another; on SmolLM2 under load that takes long, so
`--sequential N` times only the first N of them (a rate in tokens/s does not depend on how many
calls run one after another). Throughput is sampled tokens per second of wall time; both modes
sample the same kind of task with the same settings.

    PYTHONPATH=$PWD python bench/agent_batching.py                   # SmolLM2-135M-Instruct
    PYTHONPATH=$PWD python bench/agent_batching.py --model tiny      # the tiny random model (quick check)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import tinkerless
from tinkerless.functions.hosting.agent_functions import run_agent_episodes
from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams


@tinkerless.agent
async def two_calls(client, task):
    messages = [{"role": "user", "content": task["question"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") % 2)


def play(worker: Worker, tasks: list[dict], max_tokens: int, seed: int) -> tuple[int, int]:
    """(sampled tokens, calls) of one rollout of `tasks`, one copy each."""
    episodes = run_agent_episodes(
        worker.engine, worker.tokenizer, agent=two_calls, policy=BASE_POLICY, tasks=tasks, group_size=1,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0), limits=EpisodeLimits(4, 2048),
        seed=seed, timeout=600.0,
    )
    bad = [e.error for e in episodes if e.status != "ok"]
    if bad:
        raise RuntimeError(f"{len(bad)} agents failed; first: {bad[0]}")
    sampled = sum(int(e.mask.sum()) + sum(int(s.mask.sum()) for s in e.extra_sequences) for e in episodes)
    return sampled, sum(e.num_turns for e in episodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, or tiny for the random test model")
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32, help="per completion call")
    parser.add_argument("--sequential", type=int, default=None, help="time one-at-a-time on the first N agents (default: all)")
    args = parser.parse_args()
    model = build_tiny_model(tempfile.mkdtemp() + "/tiny", hidden_size=64, num_layers=2) if args.model == "tiny" else args.model
    worker = Worker(model)
    tasks = [{"question": f"What is {i} + {i * 3}? Explain briefly."} for i in range(args.agents)]
    play(worker, tasks[:2], args.max_tokens, seed=99)  # warm-up: first-call costs out of the timings

    started = time.perf_counter()
    tokens_seq, calls_seq = 0, 0
    for i, task in enumerate(tasks[: args.sequential or len(tasks)]):
        tokens, calls = play(worker, [task], args.max_tokens, seed=i)
        tokens_seq, calls_seq = tokens_seq + tokens, calls_seq + calls
        print(f"  one at a time: agent {i + 1}: {tokens_seq} tokens in {time.perf_counter() - started:.1f} s", flush=True)
    sequential_s = time.perf_counter() - started
    print(f"one at a time: {calls_seq} calls, {tokens_seq} sampled tokens in {sequential_s:.1f} s", flush=True)

    worker.engine.batcher.widest = 0
    started = time.perf_counter()
    tokens_batched, calls_batched = play(worker, tasks, args.max_tokens, seed=0)
    batched_s = time.perf_counter() - started

    seq_rate, batched_rate = tokens_seq / sequential_s, tokens_batched / batched_s
    print(f"model={args.model} agents={args.agents} calls/agent=2 max_tokens/call={args.max_tokens} "
          f"threads={worker.threads.threads} load average={os.getloadavg()[0]:.1f}")
    print(f"one at a time: {calls_seq} calls, {tokens_seq} sampled tokens in {sequential_s:.1f} s = {seq_rate:.1f} tok/s")
    print(f"batched:       {calls_batched} calls, {tokens_batched} sampled tokens in {batched_s:.1f} s = {batched_rate:.1f} tok/s "
          f"(at most {worker.engine.batcher.widest} rows in one forward)")
    print(f"speedup: {batched_rate / seq_rate:.2f}x sampled tokens/s")


if __name__ == "__main__":
    main()
