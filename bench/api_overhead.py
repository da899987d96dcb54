"""What `/v1/messages` and `/v1/responses` cost against `/v1/chat/completions`: same prompt, same tokens.

One `tinkerless serve` app on loopback HTTP; the same conversation sent to the three routes, greedy, so each
draws exactly the same tokens (checked: the completion token counts must agree, or the run stops). Requests are
interleaved round-robin (chat, messages, responses, chat, ...) so load on a shared machine hits all three alike;
each ratio is the median over rounds of a route's request time ÷ the chat request's of the same round,
non-streamed (one JSON reply) and streamed (the whole SSE body read). A plain httpx client sends all three, so no SDK's parsing is measured.

    PYTHONPATH=$PWD python bench/api_overhead.py                       # SmolLM2-135M-Instruct
    PYTHONPATH=$PWD python bench/api_overhead.py --model tiny --rounds 5   # the tiny random model (a smoke run)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import httpx

from tinkerless.functions.models import build_tiny_model
from tinkerless.functions.worker import Worker
from tinkerless.server import create_app, serve_in_thread

SYSTEM = "You are a helpful assistant."
USER = "Write one sentence about the sea."


def bodies(model: str, max_tokens: int, stream: bool) -> dict[str, dict]:
    return {
        "/v1/chat/completions": {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                                 "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                                 **({"stream_options": {"include_usage": True}} if stream else {})},
        "/v1/messages": {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                         "system": SYSTEM, "messages": [{"role": "user", "content": USER}]},
        "/v1/responses": {"model": model, "max_output_tokens": max_tokens, "temperature": 0.0, "stream": stream,
                          "instructions": SYSTEM, "input": USER},
    }


def drawn(path: str, response: httpx.Response, stream: bool) -> int:
    """Completion tokens the reply reports (usage), from its JSON or its last usage-bearing event."""
    if not stream:
        usage = response.json()["usage"]
        return usage.get("completion_tokens", usage.get("output_tokens"))
    import json

    for line in reversed(response.text.splitlines()):
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        if path == "/v1/chat/completions" and data.get("usage"):
            return data["usage"]["completion_tokens"]
        if path == "/v1/messages" and data.get("type") == "message_delta":
            return data["usage"]["output_tokens"]
        if path == "/v1/responses" and data.get("type", "").startswith("response.") and data.get("response", {}).get("usage"):
            return data["response"]["usage"]["output_tokens"]
    raise RuntimeError(f"no usage in the stream of {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help='"smollm2" or "tiny"')
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    path = build_tiny_model(tempfile.mkdtemp() + "/tiny", hidden_size=64, num_layers=2, seed=0) \
        if args.model == "tiny" else args.model
    worker = Worker(path)
    app = create_app(worker, storage=tempfile.mkdtemp(prefix="bench-apis-"))
    model = app.state.openai.base_model
    print(f"model {args.model}, {args.rounds} rounds, routes interleaved; median wall ms and (median paired ratio to chat)")
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=600) as http:
        for max_tokens in args.max_tokens:
            for stream in (False, True):
                requests = bodies(model, max_tokens, stream)
                for path, body in requests.items():  # warm-up, and the token counts must agree
                    http.post(path, json=body).raise_for_status()
                times: dict[str, list[float]] = {p: [] for p in requests}
                counts: dict[str, set[int]] = {p: set() for p in requests}
                for _ in range(args.rounds):
                    for path, body in requests.items():
                        started = time.perf_counter()
                        response = http.post(path, json=body)
                        response.raise_for_status()
                        _ = response.text
                        times[path].append(time.perf_counter() - started)
                        counts[path].add(drawn(path, response, stream))
                if len({c for cs in counts.values() for c in cs}) != 1:
                    raise SystemExit(f"the routes drew different numbers of tokens: {counts}")
                chat = times["/v1/chat/completions"]
                # Each round's time ÷ the chat request's of the same round (the load a shared machine puts on a
                # round hits the three alike), then the median of those paired ratios.
                cells = [f"{p.rsplit('/', 1)[-1]} {statistics.median(t) * 1e3:.1f} ms "
                         f"({statistics.median(a / b for a, b in zip(t, chat)):.3f}x)" for p, t in times.items()]
                tokens = next(iter(counts["/v1/chat/completions"]))
                print(f"max_tokens={max_tokens} ({tokens} drawn) {'streamed' if stream else 'plain   '}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
