"""The response object of `POST /v1/responses`, and the same response as the Responses API's streaming events.

    response.created, response.in_progress                     the response, in progress, with no output
    response.output_item.added, response.content_part.added    the message item, when the reply has text
    response.output_text.delta*                                its text as drawn
    response.output_text.done, .content_part.done, .output_item.done
    response.output_item.added, .function_call_arguments.delta/.done, .output_item.done   each function call
    response.completed (or response.incomplete, cut at max_output_tokens)
A streamed response's items, status and usage are the non-streamed one's: both come from one parse of the
finished choice (`openai_api.streaming.text_then_calls`, `render.parse_tool_calls`).
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncIterator

from tinkerless.functions.openai_api.render import strict_tool_names
from tinkerless.functions.openai_api.output import FinishedChoice
from tinkerless.functions.openai_api.streaming import Ending
from tinkerless.functions.responses_api.schemas import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponseReply:
    def __init__(self, body: ResponsesRequest, input_tokens: int, tools: list[dict]):
        self.body, self.input_tokens, self.tools = body, input_tokens, tools
        self.id, self.message_id, self.created = _id("resp"), _id("msg"), int(time.time())
        self._sequence = 0

    # -- items -------------------------------------------------------------------------------

    def message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self.text_part(text)]}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    @staticmethod
    def function_call(call: dict, item_id: str, arguments: str | None = None, status: str = "completed") -> dict:
        return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}

    def output(self, content: str | None, calls: list[dict]) -> list[dict]:
        items = [self.message(content or "")] if content or not calls else []
        return items + [self.function_call(call, _id("fc")) for call in calls]

    # -- the response ------------------------------------------------------------------------

    def response(self, output: list[dict], finished: FinishedChoice | None, calls: list[dict]) -> dict:
        incomplete = finished is not None and finished.finish_reason == "length" and not calls
        status = "in_progress" if finished is None else "incomplete" if incomplete else "completed"
        usage = None if finished is None else {
            "input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": finished.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + finished.completion_tokens}
        body = self.body
        strict = strict_tool_names(body.tools, nested=False)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": output, "parallel_tool_calls": True, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}}, "tool_choice": body.tool_choice or "auto",
            "tools": [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
                       "parameters": t["function"]["parameters"],
                       "strict": t["function"]["name"] in strict} for t in self.tools],
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": usage,
            "user": None, "metadata": {},
        }

    def full(self, finished: FinishedChoice, content: str | None, calls: list[dict]) -> dict:
        return self.response(self.output(content, calls), finished, calls)

    # -- streaming ---------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    async def events(self, pieces: AsyncIterator[str | Ending]) -> AsyncIterator[dict]:
        yield self._event("response.created", response=self.response([], None, []))
        yield self._event("response.in_progress", response=self.response([], None, []))
        text, opened, where = "", False, {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        async for piece in pieces:
            delta = piece.text if isinstance(piece, Ending) else piece
            ending = isinstance(piece, Ending)
            if not opened and (delta or (ending and not piece.calls)):
                opened = True
                yield self._event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
                yield self._event("response.content_part.added", **where, part=self.text_part(""))
            if delta:
                text += delta
                yield self._event("response.output_text.delta", **where, delta=delta, logprobs=[])
            if not ending:
                continue
            output = []
            if opened:
                yield self._event("response.output_text.done", **where, text=text, logprobs=[])
                yield self._event("response.content_part.done", **where, part=self.text_part(text))
                output.append(self.message(text))
                yield self._event("response.output_item.done", output_index=0, item=output[-1])
            for call in piece.calls:
                index, item_id = len(output), _id("fc")
                yield self._event("response.output_item.added", output_index=index,
                                  item=self.function_call(call, item_id, "", "in_progress"))
                arguments = call["function"]["arguments"]
                yield self._event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                                  delta=arguments)
                yield self._event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                                  name=call["function"]["name"], arguments=arguments)
                output.append(self.function_call(call, item_id))
                yield self._event("response.output_item.done", output_index=index, item=output[-1])
            final = self.response(output, piece.finished, piece.calls)
            self.final = final
            yield self._event("response.completed" if final["status"] == "completed" else "response.incomplete",
                              response=final)
