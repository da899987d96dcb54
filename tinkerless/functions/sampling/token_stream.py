"""A bridge from the generation thread to an asyncio consumer: each drawn token as it is drawn, then the end.

The engine runs on the server's scheduler thread; an SSE route runs on the event loop. The engine calls
`put` for every token it records for a job that has a stream, then the scheduler job calls `end` (or
`fail`). Every call hands its item to the loop with `call_soon_threadsafe`, so the generation thread
never blocks on a slow reader, and the loop side reads in order with `async for`.

`cancel` is the other direction: the route sets it when its client hangs up; the engine reads
`cancelled` at every record and ends the job's rows with stop reason "cancelled", so nothing keeps
generating for nobody.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator


@dataclass(frozen=True)
class TokenEvent:
    row: int  # the row of the request (0..n-1) that drew it
    token_id: int
    logprob: float  # the sampler's log-prob (the untempered log-softmax)
    top_logprobs: list[tuple[int, float]] | None  # the most likely tokens at this position, when asked for
    stop_reason: str | None = None  # on a row's last token: "stop" | "length" | "cancelled"


@dataclass(frozen=True)
class _End:
    result: Any


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class TokenStream:
    """Thread-safe: `put`/`end`/`fail` from any thread, iteration on the loop that created it."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._head: Any = None  # an item read by `started` and not yet iterated
        self.result: Any = None  # what `end` passed, once iteration has reached it

    # -- the generation side -----------------------------------------------------------------

    def put(self, event: TokenEvent) -> None:
        self._send(event)

    def end(self, result: Any = None) -> None:
        self._send(_End(result))

    def fail(self, error: BaseException) -> None:
        self._send(_Failed(error))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def _send(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody will read, so stop generating
            self._cancelled.set()

    # -- the consumer side ---------------------------------------------------------------------

    def cancel(self) -> None:
        self._cancelled.set()

    async def started(self) -> None:
        """Wait for the first item; raise the job's error if it failed before drawing anything (so a route
        can still answer an HTTP error: nothing has been sent yet)."""
        if self._head is None:
            self._head = await self._queue.get()
        if isinstance(self._head, _Failed):
            raise self._head.error

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            if self._head is not None:
                item, self._head = self._head, None
            else:
                item = await self._queue.get()
            if isinstance(item, _End):
                self.result = item.result
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item


class Cancellation:
    """A stream that delivers nothing: what a job whose caller waits for the whole result gets, so that it can
    be cancelled the same way (`cancel` when the caller has gone; the engine ends the rows at its next step)."""

    def __init__(self) -> None:
        self._cancelled = threading.Event()

    def put(self, event: TokenEvent) -> None:
        pass

    def end(self, result: Any = None) -> None:
        pass

    def fail(self, error: BaseException) -> None:
        pass

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


def replay(stream: TokenStream | Cancellation, rows: list[tuple[list[int], list[float], list | None, str]]) -> None:
    """Send whole rows, (token ids, log-probs, top log-probs or None, stop reason) each, token by token: what an
    engine that streams would have sent (for engines and backends that only return whole generations)."""
    for row, (tokens, logprobs, top, reason) in enumerate(rows):
        for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
            last = i == len(tokens) - 1
            stream.put(TokenEvent(row, token, logprob, top[i] if top else None, reason if last else None))
