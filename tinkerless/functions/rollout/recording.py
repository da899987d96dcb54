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
one sequence and the model conditions on what it actually produced. Every earlier reply of the sequence is
handed back so, not only the last: an agent that rebuilds its whole history from text each call (through any
API: Chat Completions, Messages, Responses) still continues one sequence. A call whose prompt holds an earlier
reply rendered otherwise than it was sampled is a render-drift turn (`drift_turns`, the step's
`render_drift_turns`): spliced back when it says the same, else the context was rewritten and a new sequence
starts; either way the sampled tokens are what trains, never the re-tokenized text.

`prove_tokens` is the proof each episode carries before it is accepted: for every call, the tokens the
sampler produced (as recorded here) are the tokens the update will train on, at mask 1 with their log-probs,
and nothing else is at mask 1. An episode whose arrays fail it is refused (`TokenProofError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tinkerless.errors import TinkerlessError
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
    spans: list[tuple[int, int]] = field(default_factory=list)  # each call's sampled tokens: [start, end)

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
        current.spans.append((len(current.tokens), len(current.tokens) + len(call.token_ids)))
        current.add(call.token_ids, sampled=True, logprobs=call.logprobs)
        current.calls += 1
    return sequences


class TokenProofError(ValueError):
    """An episode's training arrays do not hold exactly the tokens its sampler produced: it is refused."""


def prove_tokens(calls: list[RecordedCall], sequences: list[tuple], spans: list[list[tuple[int, int]]]) -> None:
    """Raise `TokenProofError` unless, call by call in order, the sampled ids and log-probs the recorder took from
    the sampler are the ids the update trains on (mask 1, at that call's span of its sequence), and no other token
    is at mask 1. `sequences` are the arrays that ship, (tokens, mask, sampler_logprobs) per sequence; `spans`
    each sequence's call spans (`Sequence.spans`)."""
    import numpy as np

    if len(sequences) != len(spans):
        raise TokenProofError(f"{len(sequences)} sequences but spans for {len(spans)}")
    order = [(k, span) for k, sequence_spans in enumerate(spans) for span in sequence_spans]
    if len(order) != len(calls):
        raise TokenProofError(f"{len(calls)} calls were sampled but {len(order)} are in the training sequences")
    sampled = [np.zeros(len(np.asarray(t)), dtype=bool) for t, _, _ in sequences]
    for turn, (call, (k, (start, end))) in enumerate(zip(calls, order)):
        tokens, mask, logprobs = (np.asarray(a) for a in sequences[k])
        if end - start != len(call.token_ids) or end > len(tokens) or start < 0 or sampled[k][start:end].any():
            raise TokenProofError(f"turn {turn}: its span [{start}, {end}) of sequence {k} does not hold its "
                                  f"{len(call.token_ids)} sampled tokens")
        if tokens[start:end].tolist() != list(call.token_ids):
            raise TokenProofError(f"turn {turn}: the tokens to train are not the tokens the sampler produced")
        if not (mask[start:end] == 1).all():
            raise TokenProofError(f"turn {turn}: a sampled token is not trained (mask 0)")
        if not np.allclose(logprobs[start:end], np.asarray(call.logprobs, dtype=np.float32), rtol=0, atol=1e-6):
            raise TokenProofError(f"turn {turn}: the log-probs to train with are not the sampler's")
        sampled[k][start:end] = True
    for k, (_, mask, _) in enumerate(sequences):
        if ((np.asarray(mask) != 0) & ~sampled[k]).any():
            raise TokenProofError(f"sequence {k} trains tokens no call sampled (mask 1 outside the sampled spans)")


# (rendered reply ids, sampled ids without the end-of-turn token, the call's stop strings) -> the same message?
SameReply = Callable[[list[int], list[int], tuple[str, ...]], bool]


class EpisodeRecorder:
    """The calls of one agent copy (one episode), in the order they were sampled."""

    def __init__(self, same_reply: SameReply | None = None):
        self.calls: list[RecordedCall] = []
        self.same_reply = same_reply
        self.spliced = 0  # re-rendered replies replaced by their sampled ids
        self.drift_turns = 0  # calls whose prompt held an earlier reply rendered otherwise than it was sampled
        self._context: list[int] = []  # the current sequence: the last call's prompt + its sampled ids
        self._spans: list[tuple[int, int, RecordedCall]] = []  # the sampled replies in _context: [start, end)

    def prompt_for(self, prompt_ids: list[int]) -> list[int]:
        """The prompt to sample from: `prompt_ids`, with each earlier reply of the current sequence given back as
        its sampled ids where the agent sent it back re-rendered but saying the same (see the module docstring).

        Walks the sequence so far (`_context`) and the new prompt side by side: where they part inside a sampled
        reply, the prompt's rendering of that reply runs to the template's first end-of-turn token; if it says
        what the sampled reply said, the sampled ids take its place and the walk goes on after it."""
        context = self._context
        if not self.calls or self.same_reply is None or extends(prompt_ids, context):
            return prompt_ids
        out: list[int] = []
        i = j = 0  # positions in context and in prompt_ids
        drifted = False
        while i < len(context):
            if j < len(prompt_ids) and context[i] == prompt_ids[j]:
                out.append(context[i])
                i, j = i + 1, j + 1
                continue
            span = next(((s, e, c) for s, e, c in self._spans if s <= i < e), None)
            if span is None:  # the context itself was rewritten, not a reply: a new sequence, as sent
                return prompt_ids
            drifted = True
            start, stop, call = span
            rendered_start = j - (i - start)
            end = next((k for k in range(rendered_start, len(prompt_ids)) if prompt_ids[k] in call.stop_token_ids), None)
            sampled = list(call.token_ids)
            closed = bool(sampled) and sampled[-1] in call.stop_token_ids
            body = sampled[:-1] if closed else sampled
            if end is None or not self.same_reply(prompt_ids[rendered_start:end], body, call.stop_strings):
                self.drift_turns += 1  # an earlier reply, rendered otherwise and not the same: a rewritten context
                return prompt_ids
            del out[len(out) - (i - start):]
            out.extend(sampled)
            self.spliced += 1
            # A sample cut by max_tokens or a stop string never drew its end-of-turn token: the template's stays (glue).
            i, j = stop, end + 1 if closed else end
        self.drift_turns += drifted
        return out + prompt_ids[j:]

    def record(self, prompt_ids: list[int], token_ids: list[int], logprobs: list[float],
               stop_token_ids: list[int] = (), stop_strings: list[str] = ()) -> None:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} sampled tokens but {len(logprobs)} log-probs")
        call = RecordedCall(list(prompt_ids), list(token_ids), [float(x) for x in logprobs],
                            tuple(stop_token_ids), tuple(stop_strings))
        if not (self.calls and extends(call.prompt_ids, self._context)):
            self._spans = []  # a new sequence (as `to_sequences` starts one)
        self._spans.append((len(call.prompt_ids), len(call.prompt_ids) + len(call.token_ids), call))
        self._context = call.prompt_ids + call.token_ids
        self.calls.append(call)

    def sequences(self) -> list[Sequence]:
        return to_sequences(self.calls)


class StaleTokensError(TinkerlessError):
    """An update was asked to train tokens sampled by a policy version older than its staleness bound allows: the
    rollouts did not sample from the weights the update expects."""


def stamp_versions(episodes: list, version: int) -> None:
    """Give every token of each episode's sequences the policy version that sampled it (`sampled_versions`: the
    version on sampled tokens, -1 elsewhere): what `check_sampled_versions` verifies at the update."""
    import numpy as np

    for episode in episodes:
        episode.sampled_versions = np.where(np.asarray(episode.mask) > 0, version, -1).astype(np.int32)
        for sequence in episode.extra_sequences:
            sequence.sampled_versions = np.where(np.asarray(sequence.mask) > 0, version, -1).astype(np.int32)


def check_sampled_versions(current: int, data: list, max_staleness: int | None) -> None:
    """Raise `StaleTokensError` unless every trained token (mask > 0) of `data` that carries its sampled version was
    sampled by a version no older than current - max_staleness: the staleness bound, verified per token. (No upper
    bound: an async run's readers restored from a checkpoint are labelled with the checkpoint's step.)"""
    import numpy as np

    if max_staleness is None:
        return
    for i, datum in enumerate(data):
        versions = getattr(datum, "sampled_versions", None)
        if versions is None:
            continue
        trained = np.asarray(versions)[np.asarray(datum.mask) > 0]
        if len(trained) and int(trained.min()) < current - max_staleness:
            raise StaleTokensError(
                f"datum {i} trains tokens sampled by policy version {int(trained.min())}, but the policy is at "
                f"version {current} and max_staleness={max_staleness}",
                hint="the rollouts did not sample from the weights this update expects; this is a bug in the "
                     "pipeline that produced them")

