"""An agent rollout in the tenant's sandbox (shared server) against the same rollout in-process.

    PYTHONPATH=. .venv/bin/python bench/hosted_agents.py [--model tiny|smollm2] [--repeats 3]

One worker. The same rollout request (2 tasks x 4 copies of a two-call agent, `--max-tokens` per
call, seeded sampling) runs in-process (no user-code hosts: the local backend / --single-user path)
and sandboxed (`functions/hosting/hosted_agents.py`: the copies in the tenant's bubblewrap host, their
requests over the rollout's channel), alternating, after one warm-up round each. Prints:

* seconds per rollout, median and minimum, each way, and their ratio;
* host start cost: a fresh tenant's first sandboxed rollout of an agent that makes no call (bwrap
  start, unpickling, the host's imports of openai/httpx) against that tenant's next (warm) one;
* fairness, through a live multi-tenant server: another tenant's one-prompt `sample` latency on an
  idle server, and while an agent rollout whose copies spend `--tool-seconds` on tool work between
  their calls is running (the rollout gives its turn away while it does not generate); then the
  same with that idle yield turned off (the rollout holds the model for its whole length: the before).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import tinkerless  # noqa: E402
from tinkerless.functions.hosting.user_code import UserCodeHosts, tenant_scope  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.sdk.backends.http import HTTPBackend  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402
from tinkerless.wire import decode_message, encode_message, pack_code  # noqa: E402
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, RolloutRequest, SampleRequest, SamplingParams  # noqa: E402


@tinkerless.agent
async def two_calls(client, task):
    import asyncio

    messages = [{"role": "user", "content": task["q"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    await asyncio.sleep(task.get("tool_seconds", 0.0))  # the agent's tool work between its calls
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].message.content or "") % 3)


@tinkerless.agent
async def no_calls(client, task):
    return 0.0


def request(max_tokens: int, seed: int, tool_seconds: float = 0.0) -> RolloutRequest:
    tasks = [{"q": "What is 2 + 3?", "tool_seconds": tool_seconds}, {"q": "Name a color.", "tool_seconds": tool_seconds}]
    return RolloutRequest(policy=BASE_POLICY, tasks=tasks, group_size=4,
                          sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0),
                          limits=EpisodeLimits(max_turns=4, max_episode_tokens=1024), seed=seed, agent=pack_code(two_calls))


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tool-seconds", type=float, default=3.0)
    args = parser.parse_args()

    worker = Worker(args.model)
    hosts = UserCodeHosts()
    times: dict[str, list[float]] = {"in-process": [], "sandboxed": []}
    try:
        worker.rollout(request(args.max_tokens, 0))  # warm-up: the model's first generate calls
        worker.user_code_hosts = hosts
        with tenant_scope("bench-cold"):  # a fresh tenant: its host starts inside this rollout
            noop = dataclasses.replace(request(args.max_tokens, 0), agent=pack_code(no_calls), group_size=1)
            cold, _ = timed(lambda: worker.rollout(noop))  # bwrap, unpickling, importing openai + httpx inside
            warm, _ = timed(lambda: worker.rollout(noop))
        for repeat in range(args.repeats):
            for mode in ("in-process", "sandboxed"):
                worker.user_code_hosts = hosts if mode == "sandboxed" else None
                with tenant_scope("bench-cold"):
                    seconds, result = timed(lambda: worker.rollout(request(args.max_tokens, 1 + repeat)))
                assert all(e.status == "ok" for e in result.episodes), [e.error for e in result.episodes]
                times[mode].append(seconds)
    finally:
        worker.user_code_hosts = None
        hosts.close()

    print(f"model={args.model} rollout = 2 tasks x 4 copies x 2 calls, max_tokens={args.max_tokens}, {args.repeats} repeats")
    for mode, values in times.items():
        print(f"  {mode:10s} median {statistics.median(values):.3f} s  min {min(values):.3f} s")
    ratio = statistics.median(times["sandboxed"]) / statistics.median(times["in-process"])
    print(f"  sandboxed / in-process (median): {ratio:.2f}x")
    print(f"  host start (an agent that makes no call): a fresh tenant's first rollout {cold:.3f} s, its next {warm:.3f} s "
          f"(start cost {cold - warm:.3f} s)")
    fairness(worker, args, idle_yield=True)
    from tinkerless.functions.hosting import hosted_agents  # the "before": the rollout holds the model while its copies work

    hosted_agents.slice_due = lambda: False
    fairness(worker, args, idle_yield=False)


def fairness(worker: Worker, args: argparse.Namespace, *, idle_yield: bool) -> None:
    """Alice's `sample` latency on an idle shared server, and while Bob's agent rollout runs."""
    storage = tempfile.mkdtemp(prefix="hosted-agents-bench-")
    keys = KeyStore(ObjectStore(storage))
    alice, bob = keys.create("alice"), keys.create("bob")
    hosts = UserCodeHosts(hide=(storage,))
    worker.user_code_hosts = hosts
    sample = SampleRequest(policy=BASE_POLICY, prompts=["hello"], sampling=SamplingParams(max_tokens=8, temperature=0.0))

    def call(key: str, method: str, message) -> object:
        backend = HTTPBackend(url, api_key=key)
        try:
            return decode_message(backend.call_bytes(method, encode_message(message)))
        finally:
            backend.close()

    try:
        with serve_in_thread(create_app(worker, keys=keys, storage=storage)) as url:
            call(bob, "rollout", request(args.max_tokens, 0))  # bob's host is warm
            idle = [timed(lambda: call(alice, "sample", sample))[0] for _ in range(5)]
            rollout_seconds: list[float] = []
            thread = threading.Thread(target=lambda: rollout_seconds.append(
                timed(lambda: call(bob, "rollout", request(args.max_tokens, 1, args.tool_seconds)))[0]))
            thread.start()
            time.sleep(0.5)
            busy = []
            while thread.is_alive() and len(busy) < 20:
                busy.append(timed(lambda: call(alice, "sample", sample))[0])
                time.sleep(0.1)
            thread.join()
    finally:
        worker.user_code_hosts = None
        hosts.close()
    print(f"fairness (live shared server, idle yield {'on' if idle_yield else 'OFF'}): bob's agent rollout with {args.tool_seconds:g} s of tool work per copy took "
          f"{rollout_seconds[0]:.2f} s")
    print(f"  alice's sample: idle server median {statistics.median(idle) * 1000:.0f} ms; during bob's rollout median "
          f"{statistics.median(busy) * 1000:.0f} ms, max {max(busy) * 1000:.0f} ms over {len(busy)} calls")


if __name__ == "__main__":
    main()
