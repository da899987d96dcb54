"""Tenant hosts across server jobs: started on the job's thread (before) or on one long-lived thread (after).

    PYTHONPATH=. .venv/bin/python bench/host_lifetime.py before|after

bwrap's --die-with-parent fires when the *thread* that started it exits. Before, a tenant's host was
started on whichever scheduler job thread first needed it and died when that job ended: the next job
paid a fresh host, and a job that loaded code into the dying host could see its episodes fail with
"no hosted object". Four env rollouts of one tenant through a shared server, seconds each.
"""

import sys, time, tempfile, concurrent.futures
from tinkerless.functions.hosting import user_code
from tinkerless.functions.hosting.user_code import UserCodeHosts
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore
from tinkerless.wire import decode_message, encode_message, pack_code
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, RolloutRequest, SamplingParams

class Inline(concurrent.futures.Executor):  # the old behaviour: spawn on the calling (job) thread
    def submit(self, fn, *a, **k):
        f = concurrent.futures.Future(); f.set_result(fn(*a, **k)); return f

def reward(completion, task): return float(len(completion) % 3)

if sys.argv[1] == "before": user_code._SPAWNER = Inline()
storage = tempfile.mkdtemp(); keys = KeyStore(ObjectStore(storage)); bob = keys.create("bob")
hosts = UserCodeHosts(hide=(storage,)); worker = Worker("tiny", user_code_hosts=hosts)
req = RolloutRequest(policy=BASE_POLICY, tasks=[{"prompt": "hi"}], group_size=2, sampling=SamplingParams(max_tokens=4), limits=EpisodeLimits(), seed=0, reward=pack_code(reward))
times = []
with serve_in_thread(create_app(worker, keys=keys, storage=storage)) as url:
    b = HTTPBackend(url, api_key=bob)
    for i in range(4):
        t = time.perf_counter(); r = decode_message(b.call_bytes("rollout", encode_message(req))); times.append(time.perf_counter() - t)
        print(i, [e.status for e in r.episodes], r.episodes[0].error and r.episodes[0].error[:120])
hosts.close()
print(sys.argv[1], "env rollouts through a shared server, s:", " ".join(f"{x:.3f}" for x in times))
