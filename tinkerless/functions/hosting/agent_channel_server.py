"""The worker's end of a sandboxed agent rollout's model channel (see `agent_channel.py`).

`ChannelServer` reads request frames from the sandbox and answers each with the same ASGI app the
in-process path uses (`agent_functions.endpoint_app` over the rollout's `PolicyBackend`): recording,
gathering concurrent copies into one generate call, masks and tool rendering are the same code.

The sandbox is hostile, so the channel checks every frame before anything else sees it:

* the bearer key must be one of this rollout's episode keys (401); each copy has its own secret key;
* only GET and POST (405), only under /v1/ (404); at most `MAX_HEADERS` headers (431); a body over
  `MAX_BODY_BYTES` is 413 (the router then 404s any model but "policy");
* at most `budget` requests per rollout (copies x (max_turns + 16)); past it every request is 429 and
  the copy that made it ends as an error episode;
* a frame that is not msgpack, is over `MAX_FRAME_BYTES`, or has the wrong shape is a violation:
  `on_violation` stops the whole host (its episodes become error episodes naming the reason) and the
  channel is closed; the next rollout starts a fresh host.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from typing import Any, Callable

from tinkerless.functions.hosting.agent_channel import (
    MAX_BODY_BYTES, MAX_HEADERS, FrameError, FrameReader, encode_frame, error_reply,
)

logger = logging.getLogger(__name__)
_PATH = re.compile(r"/v1/[A-Za-z0-9_.@:/-]*(\?[A-Za-z0-9_.~=&%+-]*)?")
_MAX_HEADER_CHARS = 8192
ENDPOINT_HOST = "http://tinkerless-worker"


class ChannelServer:
    """Answers one rollout's channel until `stop()`; `failure` says why it gave up on the sandbox, if it did."""

    def __init__(self, sock: socket.socket, app: Any, *, keys: set[str], budget: int,
                 on_done: Callable[[str], None], on_violation: Callable[[str], None]):
        sock.setblocking(False)
        self.sock, self.app, self.keys, self.budget = sock, app, keys, budget
        self.on_done, self.on_violation = on_done, on_violation
        self.requests = 0  # frames answered (a statistic, and what the budget counts)
        self.over_budget: set[str] = set()  # keys of copies that asked past the budget: error episodes
        self.failure: str | None = None
        self._finished: set[str] = set()
        self._write = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        import httpx

        loop, reader = asyncio.get_running_loop(), FrameReader()
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=ENDPOINT_HOST, timeout=None)
        try:
            while True:
                data = await loop.sock_recv(self.sock, 1 << 20)
                if not data:
                    return  # the sandbox closed its end (its rollout is over, or it died)
                for frame in reader.feed(data):
                    self._accept(frame)
        except FrameError as exc:
            self._violation(f"sent a malformed frame on its model channel: {exc}")
        except OSError:
            return
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._client.aclose()
            self.sock.close()

    def _accept(self, frame: Any) -> None:
        if isinstance(frame, dict) and set(frame) == {"done"} and isinstance(frame["done"], str):
            if frame["done"] in self.keys and frame["done"] not in self._finished:
                self._finished.add(frame["done"])
                self.on_done(frame["done"])
            return
        shape = {"id": int, "method": str, "path": str, "headers": list, "body": bytes}
        if not (isinstance(frame, dict) and set(frame) == set(shape)
                and all(isinstance(frame[k], t) and not isinstance(frame[k], bool) for k, t in shape.items())):
            raise FrameError("a frame that is not a request {id, method, path, headers, body}")
        if not all(isinstance(h, list) and len(h) == 2 and all(isinstance(p, str) for p in h) for h in frame["headers"]):
            raise FrameError("request headers that are not [name, value] string pairs")
        task = asyncio.create_task(self._answer(frame))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _violation(self, reason: str) -> None:
        if self.failure is None:
            self.failure = f"the agent's sandbox {reason}; it was stopped"
            self.on_violation(self.failure)

    async def _answer(self, frame: dict) -> None:
        try:
            reply = self._refusal(frame) or await self._dispatch(frame)
        except Exception:  # noqa: BLE001 - the route code answers errors itself; this is a bug, logged, not a hang
            logger.exception("an agent channel request failed")
            reply = error_reply(frame["id"], 500, "the worker failed to answer this request", "internal_error", "server_error")
        async with self._write:
            try:
                await asyncio.get_running_loop().sock_sendall(self.sock, encode_frame(reply))
            except OSError:
                pass  # the sandbox is gone; its rollout ends with the host's error

    def _refusal(self, frame: dict) -> dict | None:
        """The error reply for a request the channel refuses, or None to dispatch it."""
        rid, method, path, headers = frame["id"], frame["method"], frame["path"], frame["headers"]
        self.requests += 1
        key = _bearer(headers)
        if len(headers) > MAX_HEADERS or any(len(k) + len(v) > _MAX_HEADER_CHARS for k, v in headers):
            return error_reply(rid, 431, f"at most {MAX_HEADERS} headers of {_MAX_HEADER_CHARS} characters", "too_many_headers")
        if key not in self.keys:
            return error_reply(rid, 401, "this API key is not an episode of the running rollout", "invalid_api_key",
                               "authentication_error")
        if self.requests > self.budget:
            self.over_budget.add(key)
            return error_reply(rid, 429, f"this rollout's agents made more than {self.budget} requests "
                                         "(copies x (max_turns + 16)); the episode is dropped", "request_budget_exceeded",
                               "rate_limit_error")
        if method not in ("GET", "POST"):
            return error_reply(rid, 405, f"method {method[:20]!r} is not allowed: GET or POST", "method_not_allowed")
        if not _PATH.fullmatch(path) or ".." in path or "//" in path:
            return error_reply(rid, 404, f"no route {path[:200]!r}: an agent's endpoint serves /v1/ only", "not_found")
        if len(frame["body"]) > MAX_BODY_BYTES:
            return error_reply(rid, 413, f"a request body of {len(frame['body'])} bytes is over the limit of "
                                         f"{MAX_BODY_BYTES}", "request_too_large")
        return None

    async def _dispatch(self, frame: dict) -> dict:
        headers = [(k, v) for k, v in frame["headers"] if k.lower() not in ("host", "content-length", "transfer-encoding")]
        response = await self._client.request(frame["method"], frame["path"], headers=headers, content=frame["body"])
        return {"id": frame["id"], "status": response.status_code, "body": response.content,
                "headers": [[k, v] for k, v in response.headers.items() if k.lower() in ("content-type",)]}


def _bearer(headers: list) -> str | None:
    """The bearer token (OpenAI's clients), else the x-api-key header (Anthropic's), as `bearer_token` reads them."""
    keyed = None
    for name, value in headers:
        if name.lower() == "authorization" and value[:7].lower() == "bearer ":
            return value[7:].strip() or None
        if name.lower() == "x-api-key":
            keyed = value or None
    return keyed


__all__ = ["ChannelServer"]
