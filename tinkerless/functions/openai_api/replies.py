"""The OpenAI reply bodies of the POST routes: whole replies, stream chunks and `usage`.

`ChatReply` and `CompletionReply` share one shape: `full(finished)` is the non-streamed JSON reply of
finished choices; `chunk(...)` is one SSE chunk of one choice (`streaming.py` decides what goes in it);
`usage_chunk` is the last chunk when `stream_options.include_usage` asks for it. Both paths build their
`logprobs` objects with the same `output.py` functions, so a streamed choice carries exactly what the
non-streamed one does.
"""

from __future__ import annotations

import secrets
import time

from tinkerless.functions.openai_api.output import FinishedChoice, chat_logprobs, completion_logprobs
from tinkerless.functions.openai_api.render import parse_tool_calls
from tinkerless.functions.openai_api.schemas import ChatCompletionRequest, CompletionRequest


def usage(prompt_tokens: int, finished: list[FinishedChoice]) -> dict:
    completion = sum(f.completion_tokens for f in finished)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


class _Reply:
    object_full = object_chunk = ""

    def __init__(self, body, tokenizer, prompt_tokens: int, prefix: str):
        self.body, self.tokenizer, self.prompt_tokens = body, tokenizer, prompt_tokens
        self.id, self.created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())

    @property
    def include_usage(self) -> bool:
        return self.body.stream_options is not None and bool(self.body.stream_options.include_usage)

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.body.model,
                "system_fingerprint": None, "choices": choices}

    def _chunk(self, choice: dict) -> dict:
        chunk = self._envelope(self.object_chunk, [choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's chunks carry a null usage until the last one
        return chunk

    def usage_chunk(self, finished: list[FinishedChoice]) -> dict:
        return {**self._envelope(self.object_chunk, []), "usage": usage(self.prompt_tokens, finished)}


class ChatReply(_Reply):
    object_full, object_chunk = "chat.completion", "chat.completion.chunk"

    def __init__(self, body: ChatCompletionRequest, tokenizer, prompt_tokens: int, *, parse_tools: bool):
        super().__init__(body, tokenizer, prompt_tokens * body.n, "chatcmpl")
        self.parse_tools = parse_tools

    def parse(self, finished: FinishedChoice) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a choice: the same parse for both paths."""
        return parse_tool_calls(finished.text) if self.parse_tools else (finished.text, [])

    def logprobs(self, finished: FinishedChoice, start: int = 0, end: int | None = None) -> dict | None:
        return chat_logprobs(self.tokenizer, finished, start, end) if self.body.logprobs else None

    def full(self, finished: list[FinishedChoice]) -> dict:
        choices = []
        for i, f in enumerate(finished):
            content, calls = self.parse(f)
            message: dict = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append({"index": i, "message": message, "finish_reason": "tool_calls" if calls else f.finish_reason,
                            "logprobs": self.logprobs(f)})
        return {**self._envelope(self.object_full, choices), "usage": usage(self.prompt_tokens, finished)}

    def chunk(self, i: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> dict:
        return self._chunk({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason})


class CompletionReply(_Reply):
    object_full = object_chunk = "text_completion"

    def __init__(self, body: CompletionRequest, tokenizer, prompt_tokens: int):
        super().__init__(body, tokenizer, prompt_tokens, "cmpl")

    def logprobs(self, finished: FinishedChoice, start: int = 0, end: int | None = None,
                 offset: int = 0) -> dict | None:
        if self.body.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, finished, start, end, offset)

    def full(self, finished: list[FinishedChoice]) -> dict:
        choices = [{"index": i, "text": f.text, "logprobs": self.logprobs(f), "finish_reason": f.finish_reason}
                   for i, f in enumerate(finished)]
        return {**self._envelope(self.object_full, choices), "usage": usage(self.prompt_tokens, finished)}

    def chunk(self, i: int, text: str, reason: str | None = None, logprobs: dict | None = None) -> dict:
        return self._chunk({"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason})
