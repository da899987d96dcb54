"""The Anthropic reply of `POST /v1/messages`: the message body, and the same message as Anthropic's SSE events.

    message_start                        the message, empty, with usage.input_tokens
    content_block_start/delta*/stop      a text block (text_delta), when the reply has text
    content_block_start/delta/stop       each tool_use block, its input as one input_json_delta
    message_delta                        stop_reason, stop_sequence, usage.output_tokens
    message_stop
A streamed reply's blocks, stop reason and usage are the non-streamed reply's: both come from one parse of the
finished choice (`openai_api.streaming.text_then_calls`, `render.parse_tool_calls`).
"""

from __future__ import annotations

import json
import secrets
from typing import AsyncIterator

from tinkerless.functions.openai_api.output import FinishedChoice
from tinkerless.functions.openai_api.streaming import Ending


def stop_reason(finished: FinishedChoice, calls: list[dict]) -> str:
    if calls:
        return "tool_use"
    if finished.stop_string is not None:
        return "stop_sequence"
    return "end_turn" if finished.finish_reason == "stop" else "max_tokens"


def tool_use(call: dict) -> dict:
    """An OpenAI tool call (from `parse_tool_calls`) as a tool_use block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


class MessageReply:
    def __init__(self, model: str, input_tokens: int):
        self.model, self.input_tokens = model, input_tokens
        self.id = f"msg_{secrets.token_hex(12)}"

    def _message(self, content: list[dict], reason: str | None, stop: str | None, output_tokens: int) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": self._usage(output_tokens)}

    def _usage(self, output_tokens: int) -> dict:
        return {"input_tokens": self.input_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def full(self, finished: FinishedChoice, content: str | None, calls: list[dict]) -> dict:
        blocks = [{"type": "text", "text": content or ""}] if content or not calls else []
        blocks += [tool_use(call) for call in calls]
        return self._message(blocks, stop_reason(finished, calls), finished.stop_string, finished.completion_tokens)

    async def events(self, pieces: AsyncIterator[str | Ending]) -> AsyncIterator[dict]:
        yield {"type": "message_start", "message": self._message([], None, None, 0)}
        index, text_open = 0, False
        async for piece in pieces:
            text = piece.text if isinstance(piece, Ending) else piece
            if text or (isinstance(piece, Ending) and not piece.calls and not text_open):
                if not text_open:
                    yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
                    text_open = True
                if text:
                    yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
            if not isinstance(piece, Ending):
                continue
            if text_open:
                yield {"type": "content_block_stop", "index": 0}
                index = 1
            for call in piece.calls:
                block = tool_use(call)
                yield {"type": "content_block_start", "index": index,
                       "content_block": {**block, "input": {}}}
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
                yield {"type": "content_block_stop", "index": index}
                index += 1
            finished = piece.finished
            yield {"type": "message_delta",
                   "delta": {"stop_reason": stop_reason(finished, piece.calls), "stop_sequence": finished.stop_string},
                   "usage": {"output_tokens": finished.completion_tokens}}
            yield {"type": "message_stop"}
