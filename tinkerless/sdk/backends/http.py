"""`HTTPBackend`: run the functions on a `tinkerless serve` server over HTTP.

It posts the same msgpack envelopes the local backend hands its worker in-process
and returns the reply bytes, error replies included (400/413/500 carry an encoded
`ErrorReply`), so `tinkerless.sdk.backends.base.call` raises the same typed errors.
Each reply's `X-Tinkerless-Compute-Seconds` header (the server's timing of the function
body) goes into `self.usage`: queueing and network time are not billed.

Every call carries this client's stream id and a sequence number, so the server runs
them in the order they were made even when threads or retries make them arrive out of
order. A 429 (queue full), or a 503 that carries a Retry-After (a server or its proxy
restarting), is retried after the server's Retry-After, with the same sequence number,
for up to `busy_timeout` seconds; each wait is announced to `wait_listeners` (the
progress bar shows it). The stream id also names this client
as a run's driver: once another client opens (takes over) the run, the server refuses
this one's calls on the run's policies with `StaleDriver` (409).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import uuid

import httpx

from tinkerless.errors import RemoteError, ServerBusy, ServerUnreachable
from tinkerless.sdk.run.accounting import UsageMeter
from tinkerless.wire.http import (COMPUTE_SECONDS_HEADER, MODEL_HEADER, MSGPACK, QUEUE_SECONDS_HEADER, SEQ_HEADER,
                                  STREAM_HEADER)

_ENVELOPE_STATUSES = (200, 400, 401, 402, 404, 409, 413, 500, 503)  # statuses whose body is a msgpack envelope from the server
# Called with (seconds, why) before each wait on a busy server: the progress bar shows it (`run/progress.py`).
wait_listeners: list = []
_START_HINT = "start the server with `tinkerless serve --host 127.0.0.1 --port 8000 --model MODEL` and check the URL"


class HTTPBackend:
    """A Backend whose functions run on a tinkerless HTTP server at `base_url`."""

    name = "http"

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        busy_timeout: float = 300.0,
    ):
        self.base_url = base_url.rstrip("/")
        api_key = api_key or os.environ.get("TINKERLESS_API_KEY")
        # A call may compute for minutes (rollouts, updates); only connecting should fail fast.
        self._client = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        )
        self.usage = UsageMeter(source="the server (X-Tinkerless-Compute-Seconds)")
        self.busy_timeout = busy_timeout
        self._stream = uuid.uuid4().hex
        self._seq = itertools.count(1)
        self._seq_lock = threading.Lock()

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        return self.post(f"/v1/call/{method}", payload, label=method)

    def post(self, path: str, payload: bytes, *, label: str, ordered: bool = True, model: str | None = None,
             usage: UsageMeter | None = None) -> bytes:
        """POST a msgpack envelope to `path`; the reply's bytes (error envelopes included). `model`: one of the
        server's extra models instead of its main one (`served_model.ServedModelBackend`), its seconds in `usage`.

        `ordered` calls carry this client's stream and next sequence number: the server runs
        them on the model in that order. Coordinator calls (`ordered=False`) skip the queue; they
        carry the stream alone, so a run opened here fences off its earlier driver's worker calls."""
        url = f"{self.base_url}{path}"
        headers = {"Content-Type": MSGPACK, STREAM_HEADER: self._stream}
        if model is not None:
            headers[MODEL_HEADER] = model
        if ordered:
            with self._seq_lock:
                headers.update({STREAM_HEADER: self._stream, SEQ_HEADER: str(next(self._seq))})
        started = time.perf_counter()
        deadline = time.monotonic() + self.busy_timeout
        while True:
            response = self._post(label, url, path, payload, headers)
            status = response.status_code
            if status != 429 and not (status == 503 and "retry-after" in response.headers):
                break
            wait = _retry_after(response)
            if time.monotonic() + wait > deadline:
                raise ServerBusy(
                    f"{url} stayed busy (HTTP {status}, {'queue full' if status == 429 else 'unavailable'}) "
                    f"for {self.busy_timeout:.0f}s",
                    hint="the server is overloaded or restarting: retry later, raise HTTPBackend(busy_timeout=...), "
                    "or start more servers",
                )
            for listener in list(wait_listeners):
                listener(wait, f"{label}: HTTP {status}, retrying after {wait:.0f}s")
            time.sleep(wait)
        if response.status_code in _ENVELOPE_STATUSES and response.headers.get("content-type", "").startswith(MSGPACK):
            if ordered:
                self._record(label, response, time.perf_counter() - started, usage or self.usage)
            return response.content
        raise _remote_error(
            f"{url} answered HTTP {response.status_code} without a tinkerless reply: {response.text[:200]!r}",
            "check that the URL points at a `tinkerless serve` server (not a proxy or another service)",
        )

    def run_host(self, local_dir: str = "."):
        """Where runs through this backend live: on the server (coordinator and checkpoints)."""
        from tinkerless.sdk.backends.server_runs import ServerRunHost

        return ServerRunHost(self, local_dir=local_dir)

    def _post(self, method: str, url: str, path: str, payload: bytes, headers: dict[str, str]) -> httpx.Response:
        try:
            return self._client.post(path, content=payload, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ServerUnreachable(f"{method} failed: cannot reach the tinkerless server at {self.base_url} ({exc})",
                                    hint=_START_HINT) from exc
        except httpx.TimeoutException as exc:
            raise _remote_error(
                f"{method} on {url} did not answer in time ({exc})",
                "raise HTTPBackend(timeout=...) for long calls, or check the server's log",
            ) from exc
        except httpx.TransportError as exc:
            raise ServerUnreachable(
                f"connection to {url} failed during {method} ({type(exc).__name__}: {exc})",
                hint="check that the server is still running (its log says why it stopped) and retry",
            ) from exc

    def get(self, path: str, params: dict | None = None) -> httpx.Response:
        """GET `path` (the server's listings), its response as it came."""
        try:
            return self._client.get(path, params=params)
        except httpx.TransportError as exc:
            raise ServerUnreachable(f"GET {path} failed: cannot reach the tinkerless server at {self.base_url} ({exc})",
                                    hint=_START_HINT) from exc

    def _record(self, method: str, response: httpx.Response, wall_seconds: float, usage: UsageMeter) -> None:
        """Bill the server's timing; a reply without it (an older server, a proxy that drops headers)
        that still ran the function is billed at the client's wall time, marked as such."""
        try:
            seconds = float(response.headers[COMPUTE_SECONDS_HEADER])
        except (KeyError, ValueError):
            seconds = math.nan
        try:  # how long the call waited for the model behind other calls (not billed: no function ran)
            queued = float(response.headers.get(QUEUE_SECONDS_HEADER, "nan"))
        except ValueError:
            queued = math.nan
        if math.isfinite(queued) and queued >= 0:
            usage.record_queue(queued)
        if math.isfinite(seconds) and seconds >= 0:
            usage.record(method, seconds)
        elif response.status_code == 200:  # error replies without the header were refused before any function ran
            usage.record(method, wall_seconds, client_timed=True)

    def close(self) -> None:
        self._client.close()

    def reopen(self) -> None:
        """After the server came back: a fresh connection pool and a fresh call stream (a restarted server
        numbers streams afresh; the run this client drives is opened again by its resume)."""
        self._client.close()
        self._client = httpx.Client(base_url=self.base_url, timeout=self._client.timeout, headers=self._client.headers)
        with self._seq_lock:
            self._stream, self._seq = uuid.uuid4().hex, itertools.count(1)


def wait_for_server(base_url: str, timeout: float, *, on_wait=None) -> bool:
    """Poll the server's /healthz with backoff (0.5 s doubling to 5 s) until it answers, for up to `timeout`
    seconds; whether it came back. `on_wait(seconds, why)` is told of each wait."""
    deadline, delay = time.monotonic() + timeout, 0.5
    while True:
        try:
            if httpx.get(f"{base_url.rstrip('/')}/healthz", timeout=5.0).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() + delay > deadline:
            return False
        if on_wait is not None:
            on_wait(delay, f"the server at {base_url} is unreachable: reconnecting in {delay:.1f}s")
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(max(float(response.headers.get("retry-after", "1")), 0.1), 30.0)
    except ValueError:
        return 1.0


def _remote_error(message: str, hint: str) -> RemoteError:
    return RemoteError(message, hint=hint)
