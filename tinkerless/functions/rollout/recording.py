"""An agent's completion calls, recorded token for token, turned into training sequences.

Every call an agent makes through the worker's OpenAI-compatible endpoint is recorded as
(prompt ids, sampled ids, the sampler's log-probs): exactly what the model was given and what
it drew, never text tokenized again. The calls of one episode become sequences:

* A call whose prompt extends the previous call's prompt + completion continues that call's
  sequence: the new prompt tokens (the template's glue, tool results, the next user message)
  go in with mask 0, the sampled tokens with mask 1 and their log-probs.
* A call whose prompt does not (the agent dropped, edited or summarized its context) starts a
  new sequence. All of an episode's sequences are trained with the episode's one advantage.

`EpisodeRecorder.prompt_for` also hands the model its own tokens back: an agent that appends
the assistant message it received and asks again sends text that the router renders and
tokenizes anew, which need not give the ids the sampler drew (tokenization is not unique,
tool-call JSON is re-serialized). When the rendered reply says the same as the sampled one
(`same_reply`), its span in the new prompt is replaced by the sampled ids, so the turns stay
one sequence and the model conditions on what it actually produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tinkerless.wire.messages import TrainingSequence


@dataclass(frozen=True)
class RecordedCall:
    prompt_ids: list[int]  # what the model was given (after `prompt_for`)
    token_ids: list[int]  # what the sampler drew, stop token included when one ended the sample
    logprobs: list[float]  # the sampler's log-prob of each drawn token
    stop_token_ids: tuple[int, ...] = ()  # the tokens that would have ended this sample
    stop_strings: tuple[str, ...] = ()  # the strings that cut it (the reply's text ends before one)


@dataclass
class Sequence:
    tokens: list[int] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prompt_length: int = 0  # tokens before the first sampled one
    calls: int = 0

    def add(self, tokens: list[int], *, sampled: bool, logprobs: list[float] | None = None) -> None:
        self.tokens.extend(tokens)
        self.mask.extend([1.0 if sampled else 0.0] * len(tokens))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))

    def as_wire(self) -> TrainingSequence:
        return TrainingSequence(
            tokens=np.asarray(self.tokens, dtype=np.int32),
            mask=np.asarray(self.mask, dtype=np.float32),
            sampler_logprobs=np.asarray(self.logprobs, dtype=np.float32),
        )


def extends(prompt: list[int], prefix: list[int]) -> bool:
    return len(prompt) >= len(prefix) and prompt[: len(prefix)] == prefix


def to_sequences(calls: list[RecordedCall]) -> list[Sequence]:
    """The training sequences of an episode's calls, in call order (see the module docstring)."""
    sequences: list[Sequence] = []
    for call in calls:
        current = sequences[-1] if sequences else None
        if current is not None and extends(call.prompt_ids, current.tokens):
            current.add(call.prompt_ids[len(current.tokens) :], sampled=False)
        else:
            current = Sequence()
            current.add(call.prompt_ids, sampled=False)
            current.prompt_length = len(call.prompt_ids)
            sequences.append(current)
        current.add(call.token_ids, sampled=True, logprobs=call.logprobs)
        current.calls += 1
    return sequences


# (rendered reply ids, sampled ids without the end-of-turn token, the call's stop strings) -> the same message?
SameReply = Callable[[list[int], list[int], tuple[str, ...]], bool]


class EpisodeRecorder:
    """The calls of one agent copy (one episode), in the order they were sampled."""

    def __init__(self, same_reply: SameReply | None = None):
        self.calls: list[RecordedCall] = []
        self.same_reply = same_reply
        self.spliced = 0  # prompts where a re-rendered reply was replaced by its sampled ids

    def prompt_for(self, prompt_ids: list[int]) -> list[int]:
        """The prompt to sample from: `prompt_ids`, with the last reply's sampled ids in place of its
        re-rendering when the agent sent that reply back unchanged (see the module docstring)."""
        if not self.calls or self.same_reply is None:
            return prompt_ids
        last = self.calls[-1]
        if extends(prompt_ids, last.prompt_ids + last.token_ids) or not extends(prompt_ids, last.prompt_ids):
            return prompt_ids  # already the sampled ids, or a rewritten context: nothing to hand back
        start = len(last.prompt_ids)
        # The rendered reply ends at the first end-of-turn token after the old prompt (the template closes it).
        end = next((i for i in range(start, len(prompt_ids)) if prompt_ids[i] in last.stop_token_ids), None)
        if end is None:
            return prompt_ids
        sampled = list(last.token_ids)
        closed = bool(sampled) and sampled[-1] in last.stop_token_ids
        body = sampled[:-1] if closed else sampled
        if not self.same_reply(prompt_ids[start:end], body, last.stop_strings):
            return prompt_ids
        self.spliced += 1
        # A sample cut by max_tokens or a stop string never drew its end-of-turn token: the template's one stays (glue).
        return prompt_ids[:start] + sampled + ([] if closed else [prompt_ids[end]]) + prompt_ids[end + 1 :]

    def record(self, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
               stop_token_ids: list[int] = (), stop_strings: list[str] = ()) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} log-probs")
        self.calls.append(RecordedCall(list(prompt_ids), list(token_ids), [float(x) for x in logprobs],
                                       tuple(stop_token_ids), tuple(stop_strings)))

    def sequences(self) -> list[Sequence]:
        return to_sequences(self.calls)
