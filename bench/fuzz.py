"""Fuzz `tinkerless serve` at scale: hostile requests on every route, and the table of status codes they got.

    PYTHONPATH=. .venv/bin/python bench/fuzz.py [--requests 5000] [--seed 0]

Starts a server on 127.0.0.1 (auth on, tenants alice and bob, a tiny random model, storage in a
temporary directory), then sends `--requests` requests drawn by the strategies of
`tests/fuzz_cases.py` (mutated templates, raw bodies, headers: the ones tests/test_fuzz.py runs a few
hundred of) and `tests/schema_fuzz.py` (every field of every msgpack route's wire message, values drawn
from its type: tests/test_schema_fuzz.py), half each, with a random seed.
Prints the request count, a status-code table per API (target: no 5xx), whether the server
still answers a normal call, and whether any file landed outside the tenants' prefixes.
Exits 1 on any 5xx.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fuzz_cases import Target, prepare, requests, still_serves  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schema_fuzz import schema_requests  # noqa: E402

from tinkerless.server.budgets import USAGE_FILE  # noqa: E402

from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402


def _api(path: str) -> str:
    if path.startswith("/v1/call/"):
        return "msgpack /v1/call"
    if path.startswith("/v1/runs/"):
        return "msgpack /v1/runs"
    if path.startswith("/api/v1/"):
        return "Tinker /api/v1"
    return "healthz, metrics"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tinkerless-fuzz-"))
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0)
    storage = root / "storage"
    keys = KeyStore(ObjectStore(str(storage)))
    tenants = {name: keys.create(name) for name in ("alice", "bob")}
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    kinds: dict[str, str] = {}  # route -> one request that got a 5xx there
    with serve_in_thread(create_app(Worker(model), keys=keys, storage=str(storage))) as url:
        target = prepare(Target(url, tenants))
        before = {p for p in storage.rglob("*") if p.is_file()}

        @seed(args.seed)
        @settings(max_examples=args.requests, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(data=st.one_of(requests(target), schema_requests(target)))
        def one(data):
            response = data.send(target)
            table[_api(data.path)][response.status_code] += 1
            if response.status_code >= 500:
                kinds[f"{data.method} {data.path[:60]}"] = f"{data.body[:200]!r} -> {response.content[:400]!r}"

        started = time.perf_counter()
        one()
        seconds = time.perf_counter() - started
        still_serves(target)
        # The server's own meter (per-key usage, written after calls) is the one file it keeps outside the tenants'.
        outside = [p for p in sorted(storage.rglob("*")) if p.is_file() and p not in before
                   and not str(p.relative_to(storage)).startswith(("tenants/alice/", "tenants/bob/"))
                   and str(p.relative_to(storage)) != USAGE_FILE]

    statuses = sorted({s for counts in table.values() for s in counts})
    total = sum(sum(c.values()) for c in table.values())
    print(f"{total} requests in {seconds:.0f}s (seed {args.seed}); server still serves a normal call: yes; "
          f"files outside the tenants' prefixes: {len(outside)}")
    print("| API | " + " | ".join(str(s) for s in statuses) + " | 5xx |")
    print("|---|" + "---:|" * (len(statuses) + 1))
    for api, counts in sorted(table.items()):
        fives = sum(n for s, n in counts.items() if s >= 500)
        print(f"| {api} | " + " | ".join(str(counts.get(s, 0)) for s in statuses) + f" | {fives} |")
    for route, example in kinds.items():
        print(f"5xx on {route}: {example}")
    for path in outside[:20]:
        print(f"written outside the tenants' prefixes: {path.relative_to(storage)}")
    return 1 if kinds or outside else 0


if __name__ == "__main__":
    sys.exit(main())
