"""A `CompletionBackend` whose model replies a script, turn by turn: the routes' own parsing and shapes are what
is tested with it (the tiny random model never writes a tool call)."""

from __future__ import annotations

import openai

from tinkerless.functions.openai_api.backend import SampledChoice
from tinkerless.functions.rollout.chat import ChatFormat

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class ScriptedModel:
    """Replies `replies[turn]` (then its end of turn) to every request; `turn` advances only when told to, or on each
    call with `advance=True`. Records every prompt it was given."""

    def __init__(self, tokenizer, replies: list[str], *, advance: bool = False):
        self._tokenizer = tokenizer
        end = ChatFormat(tokenizer).end_of_turn_id
        self.replies = [tokenizer.encode(r, add_special_tokens=False) + [end] for r in replies]
        self.advance, self.turn = advance, 0
        self.prompts: list[list[int]] = []

    def tokenizer(self):
        return self._tokenizer

    def models(self, caller):
        return ["scripted"]

    async def sample(self, caller, model, request, cancel=None):
        self.prompts.append(list(request.prompt_ids))
        ids = self.replies[min(self.turn, len(self.replies) - 1)][: request.max_tokens]
        if self.advance:
            self.turn += 1
        return [SampledChoice(ids, [-0.5] * len(ids), None, ids[-1] in request.stop_token_ids)] * request.n


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
