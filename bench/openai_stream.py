"""Time to the first streamed chunk against the whole reply, through `tinkerless serve`'s OpenAI API.

A server in a process of its own on 127.0.0.1 (`server_process.py`), driven with the official `openai` client
as an outside client would. Per round, the same chat request (greedy, so every request draws the same tokens)
three ways, interleaved so that machine load hits each alike:
  * plain: `stream=False`, the time to the whole reply;
  * streamed: `stream=True`, the time to the first chunk with text and to the last chunk.
Before token-by-token streaming, the first chunk came only once the whole generation had ended: run the same
script against the older code (PYTHONPATH=<old checkout>) for the "before".

    PYTHONPATH=$PWD python bench/openai_stream.py                   # SmolLM2-135M-Instruct ("smollm2")
    PYTHONPATH=$PWD python bench/openai_stream.py --model tiny      # the tiny random model (a smoke run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, os.path.dirname(__file__))
from server_process import serve_process  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def plain(client: openai.OpenAI, model: str, max_tokens: int) -> tuple[float, int]:
    started = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0)
    return time.perf_counter() - started, reply.usage.completion_tokens


def streamed(client: openai.OpenAI, model: str, max_tokens: int) -> tuple[float, float, int]:
    """(seconds to the first chunk with text, seconds to the last chunk, completion tokens)."""
    started, first, tokens = time.perf_counter(), None, 0
    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first, time.perf_counter() - started, tokens


def ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.0f} ms  (min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model = args.model
    if model == "tiny":
        from tinkerless.functions.models import build_tiny_model

        model = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", hidden_size=64, num_layers=2, seed=0)
    with tempfile.TemporaryDirectory() as root, serve_process(model, Path(root), threads=args.threads) as served:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=served.api_key, max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        plain(client, name, 4)  # warm-up: first forward, tokenizer, template
        whole, first, last, counts = [], [], [], set()
        for _ in range(args.rounds):
            seconds, tokens = plain(client, name, args.max_tokens)
            whole.append(seconds)
            counts.add(tokens)
            to_first, to_last, tokens = streamed(client, name, args.max_tokens)
            first.append(to_first)
            last.append(to_last)
            counts.add(tokens)
    print(f"model {args.model}, {args.rounds} rounds, completion tokens per request {sorted(counts)}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"  plain (whole reply)       {ms(whole)}")
    print(f"  streamed: first chunk     {ms(first)}")
    print(f"  streamed: last chunk      {ms(last)}")


if __name__ == "__main__":
    main()
