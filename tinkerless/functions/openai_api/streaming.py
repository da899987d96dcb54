"""SSE streaming of the POST routes: each choice's text as the engine draws its tokens.

`open_streams` starts the backend's jobs and waits for each one's first item, so a request that fails before
drawing anything (a bad adapter, a full queue) is still an HTTP error with the OpenAI error body. After the
first byte, an error becomes an SSE `error` event and the stream ends. A client that hangs up cancels the
jobs (`TokenStream.cancel`): the engine ends their rows at its next step.

`ChoiceText` turns one choice's tokens into text deltas that are final when sent:
  * incremental detokenization (`PieceDecoder`): a token that ends inside a UTF-8 character adds nothing
    until the character completes, so no delta holds a U+FFFD the whole text does not;
  * stop strings (`StopScanner`): text that could be the start of a stop string is held back until the
    next tokens decide; the text ends right before the first stop string, as the non-streamed reply's;
  * tool calls (chat with tools): text from a possible `<tool_call>` opener on (and trailing whitespace)
    is held back; at the end the whole text goes through the non-streamed path's parse and the calls are
    sent as one `tool_calls` delta.
The deltas of a choice concatenate to the non-streamed reply's text, its token logprobs are the same, and
each chunk's logprobs are those of the tokens whose text it completes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from tinkerless.envs.tools import _TOOL_CALL_OPEN
from tinkerless.functions.sampling.token_stream import TokenEvent, TokenStream, replay
from tinkerless.functions.openai_api.backend import TokenSampling
from tinkerless.functions.openai_api.output import FinishedChoice, PieceDecoder, StopScanner, clip_pieces
from tinkerless.functions.openai_api.replies import ChatReply, CompletionReply

logger = logging.getLogger(__name__)

# The start of a `<tool_call>` opener that the next tokens may complete (_TOOL_CALL_OPEN, cut anywhere).
_OPENER_START = re.compile(r"<\s*(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l\s*)?)?)?)?)?)?)?)?)?", re.IGNORECASE)


class ChoiceText:
    """One choice's tokens in, its final text deltas and the tokens they complete out (see the module doc)."""

    def __init__(self, tokenizer, stop_strings: list[str], stop_token_ids: list[int], *, top_logprobs: bool,
                 hold_tool_calls: bool = False):
        self.decoder = PieceDecoder(tokenizer)
        self.scanner = StopScanner(stop_strings)
        self.stop_ids = set(stop_token_ids)
        self.hold_tool_calls = hold_tool_calls
        self.pieces: list[str] = []
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list | None = [] if top_logprobs else None
        self.drawn = 0  # tokens drawn for the choice (a stop token included): usage
        self.reason: str | None = None  # set once the choice has ended
        self.sent = 0  # characters of text sent
        self.released = 0  # tokens whose logprobs were sent
        self.released_end = 0  # where the text of the released tokens ends

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def text(self) -> str:
        return self.scanner.text if self.scanner.cut is None else self.scanner.text[: self.scanner.cut]

    def add(self, event: TokenEvent) -> None:
        if self.done:  # drawn after a stop string ended the choice: not part of it (nor of usage)
            return
        self.drawn += 1
        if event.stop_reason == "stop" and event.token_id in self.stop_ids:  # counted, but no text nor logprobs
            rest = self.decoder.flush()
            if rest:
                self.pieces[-1] += rest
            self._scan(rest, "stop")
            return
        piece = self.decoder.add(event.token_id)
        if event.stop_reason is not None:
            piece += self.decoder.flush()
        self.tokens.append(event.token_id)
        self.logprobs.append(event.logprob)
        if self.top is not None:
            self.top.append(event.top_logprobs or [])
        self.pieces.append(piece)
        self._scan(piece, None if event.stop_reason is None else "stop" if event.stop_reason == "stop" else "length")

    def _scan(self, piece: str, reason: str | None) -> None:
        if self.scanner.add(piece):  # a stop string: the text ends before it, the tokens with the one completing it
            self.pieces = clip_pieces(self.pieces, self.scanner.cut)
            self.drawn, self.reason = len(self.tokens), "stop"
        else:
            self.reason = reason

    def _sendable(self) -> int:
        """How much of the text is final: all of it once the choice has ended, else what no later token can
        turn into a stop string (nor, with tools, into a tool call)."""
        if self.done:
            return len(self.text)
        limit = self.scanner.stable()
        if self.hold_tool_calls:
            text = self.scanner.text[:limit]
            opener = _TOOL_CALL_OPEN.search(text, self.sent)  # none before: the text sent stops short of any
            if opener is not None:
                limit = opener.start()
            else:
                last = text.rfind("<")
                if last >= 0 and _OPENER_START.fullmatch(text, last):
                    limit = last
            while limit > 0 and text[limit - 1].isspace():  # a reply with calls has its trailing whitespace cut
                limit -= 1
        return max(limit, self.sent)

    def take(self) -> tuple[str, int, int]:
        """(text delta, start, end): the text that became final since the last call, and the tokens [start, end)
        whose text it completes (all the remaining ones once the choice has ended)."""
        limit = self._sendable()
        delta, self.sent = self.text[self.sent:limit], limit
        start = end = self.released
        while end < len(self.tokens) and (self.done or self.released_end + len(self.pieces[end]) <= self.sent):
            self.released_end += len(self.pieces[end])
            end += 1
        self.released = end
        return delta, start, end

    def finished(self) -> FinishedChoice:
        """The choice so far, as `output.finish` makes it of the whole generation (the lists are shared, not copied:
        a chunk's logprobs read a few entries of them each token)."""
        return FinishedChoice(self.pieces, self.tokens, self.logprobs, self.top, self.drawn, self.reason or "length",
                              self.scanner.matched)


async def open_streams(backend, who: str, model: str, requests: list[TokenSampling]) -> list[TokenStream]:
    """One stream per request, each with its first item already there (a failure before it raises here)."""
    streams: list[TokenStream] = []
    try:
        for request in requests:
            if hasattr(backend, "sample_stream"):
                streams.append(await backend.sample_stream(who, model, request))
            else:  # a backend that answers whole choices: they are replayed token by token
                streams.append(_replayed(await backend.sample(who, model, request)))
        for stream in streams:
            await stream.started()
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def _replayed(choices) -> TokenStream:
    stream = TokenStream()
    replay(stream, [(c.token_ids, c.logprobs, c.top_logprobs, "stop" if c.stopped else "length") for c in choices])
    stream.end(choices)
    return stream


async def _events(streams: list[TokenStream], per_stream: int) -> AsyncIterator[tuple[int, TokenEvent]]:
    """(choice index, event) of every stream as they come; choice i*per_stream + row for stream i's row."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield event.row, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: TokenStream) -> None:
        try:
            async for event in stream:
                await queue.put((i * per_stream + event.row, event))
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()


def _settled(streams: list[TokenStream], choices: list[ChoiceText], i: int) -> bool:
    """Choice i has ended: once every choice of its stream has, the engine may still be drawing past a stop
    string, for nobody: cancel that job. True when every choice has ended (the reply is complete)."""
    per_stream = len(choices) // len(streams)
    stream = i // per_stream
    if all(c.done for c in choices[stream * per_stream:(stream + 1) * per_stream]):
        streams[stream].cancel()
    return all(c.done for c in choices)


async def chat_chunks(reply: ChatReply, streams: list[TokenStream], choices: list[ChoiceText]) -> AsyncIterator[dict]:
    for i in range(len(choices)):
        yield reply.chunk(i, {"role": "assistant", "content": ""})
    async for i, event in _events(streams, len(choices)):
        choice = choices[i]
        if choice.done:
            continue
        choice.add(event)
        delta, start, end = choice.take()
        logprobs = reply.logprobs(choice.finished(), start, end) if end > start else None
        if not choice.done:
            if delta or logprobs:
                yield reply.chunk(i, {"content": delta}, logprobs=logprobs)
            continue
        finished = choice.finished()
        content, calls = reply.parse(finished)
        if calls:  # the content the parse kept, past what was sent, then the calls whole
            sent = choice.text[: choice.sent - len(delta)]
            delta = (content or "")[len(sent):] if (content or "").startswith(sent) else ""
        if delta or logprobs:
            yield reply.chunk(i, {"content": delta}, logprobs=logprobs)
        if calls:
            yield reply.chunk(i, {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]})
        yield reply.chunk(i, {}, "tool_calls" if calls else finished.finish_reason)
        if _settled(streams, choices, i):
            break
    if reply.include_usage:
        yield reply.usage_chunk([c.finished() for c in choices])


async def completion_chunks(reply: CompletionReply, streams: list[TokenStream],
                            choices: list[ChoiceText]) -> AsyncIterator[dict]:
    async for i, event in _events(streams, len(choices) // len(streams)):
        choice = choices[i]
        if choice.done:
            continue
        offset = choice.released_end
        choice.add(event)
        delta, start, end = choice.take()
        logprobs = reply.logprobs(choice.finished(), start, end, offset) if end > start else None
        if delta or logprobs:
            yield reply.chunk(i, delta, logprobs=logprobs)
        if choice.done:
            yield reply.chunk(i, "", choice.finished().finish_reason)
            if _settled(streams, choices, i):
                break
    if reply.include_usage:
        yield reply.usage_chunk([c.finished() for c in choices])


@dataclass
class Ending:
    """How a choice ended, for APIs that send text then tool calls (Messages, Responses): the last text delta
    (with calls: the content the parse kept, past what was sent), the calls, the finished choice."""

    text: str
    calls: list[dict]
    finished: FinishedChoice


async def text_then_calls(streams: list[TokenStream], choice: ChoiceText,
                          parse: Callable[[FinishedChoice], tuple[str | None, list[dict]]]) -> AsyncIterator[str | Ending]:
    """One choice (n=1) as text deltas while it is drawn, then its `Ending`: the same text, hold-backs and parse as
    `chat_chunks`, for the APIs whose events are not chat chunks."""
    async for _, event in _events(streams, 1):
        choice.add(event)
        delta, _, _ = choice.take()
        if not choice.done:
            if delta:
                yield delta
            continue
        finished = choice.finished()
        content, calls = parse(finished)
        if calls:
            sent = choice.text[: choice.sent - len(delta)]
            delta = (content or "")[len(sent):] if (content or "").startswith(sent) else ""
        streams[0].cancel()  # it may still be drawing past a stop string, for nobody
        yield Ending(delta, calls, finished)
        return
    yield Ending("", [], choice.finished())  # a stream that ended without a last token (cancelled before one)


def data_frame(chunk: dict) -> bytes:
    """An OpenAI chat / completions SSE frame: data only."""
    return f"data: {json.dumps(chunk)}\n\n".encode()


def named_frame(chunk: dict) -> bytes:
    """An Anthropic Messages / OpenAI Responses SSE frame: the event named by the chunk's `type`, then its data."""
    return f"event: {chunk['type']}\ndata: {json.dumps(chunk)}\n\n".encode()


def sse_response(request: Request, chunks: AsyncIterator[dict], streams: list[TokenStream],
                 error_body: Callable[[BaseException], tuple[int, dict]], *,
                 frame: Callable[[dict], bytes] = data_frame, trailer: bytes = b"data: [DONE]\n\n") -> StreamingResponse:
    """The SSE reply of `chunks`, each written by `frame`, then `trailer`; an error after the first byte is an
    `error` event whose data is `error_body`'s. The jobs are cancelled when it ends early (the client hung up,
    an error)."""

    def cancel() -> None:
        for stream in streams:
            stream.cancel()

    async def watch_disconnect() -> None:  # the send that would notice it may be far off (text held back)
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel()

    async def body() -> AsyncIterator[bytes]:
        watcher = asyncio.create_task(watch_disconnect())
        try:
            async for chunk in chunks:
                yield frame(chunk)
            if trailer:
                yield trailer
        except Exception as exc:  # noqa: BLE001 - after the first byte an error can only be an event
            _, error = error_body(exc)
            yield f"event: error\ndata: {json.dumps(error)}\n\n".encode()
        finally:
            watcher.cancel()
            cancel()  # a no-op for jobs that have ended

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
