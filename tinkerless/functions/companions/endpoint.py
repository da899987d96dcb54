"""A teacher served elsewhere: prompt log-probs from an OpenAI-compatible `/v1/completions` endpoint.

The request is the classic prompt-scoring form vLLM and OpenAI-style servers answer: the student's whole
sequence as text (its chat frame included, special tokens written out), `echo: true`, `logprobs: 0`,
`max_tokens: 0`. The reply's `logprobs` holds the teacher's tokens, each one's log-prob given the text before it
(`token_logprobs`, the first null) and where each starts in the text (`text_offset`). Student and teacher tokens
are then paired by character spans, as for a local teacher with another tokenizer (`alignment`): with the same
tokenizer every pair is one token to one token.

`teacher="http://host:port/v1"` asks for the endpoint's model as `default`; `teacher="http://host:port/v1#model=NAME"`
names it. A teacher that times out or fails is an infrastructure failure (`teacher_timeout`, `teacher_failed`):
the step stops, resumable, instead of training on a guess.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tinkerless.errors import InfrastructureFailure
from tinkerless.functions.companions.alignment import UNREADABLE, TeacherRendering, _covering, sampled_turns

TIMEOUT_S = 120.0


def parse_endpoint(spec: str) -> tuple[str, str]:
    """(base URL, model name) of `http://host:port/v1[#model=NAME]`."""
    url, _, fragment = spec.partition("#")
    model = fragment[len("model="):] if fragment.startswith("model=") else "default"
    return url.rstrip("/"), model or "default"


def student_spans(tokenizer: Any, tokens: list[int], mask: np.ndarray) -> tuple[str, list[tuple[int, int | None]]]:
    """The sequence as text (special tokens written out) and, per sampled token, (turn start, end) in it: None
    where the token ends inside a character. Turns are decoded on their own and placed after the text before
    them; a turn whose text does not sit there verbatim gets no spans (nothing of it aligns)."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    spans: list[tuple[int, int | None]] = [(0, None)] * len(tokens)
    for turn in sampled_turns(mask):
        start = len(tokenizer.decode(tokens[: turn[0]], skip_special_tokens=False))
        turn_ids = [tokens[p] for p in turn]
        turn_text = tokenizer.decode(turn_ids, skip_special_tokens=False)
        if text[start:start + len(turn_text)] != turn_text:
            continue
        for k, position in enumerate(turn):
            prefix = tokenizer.decode(turn_ids[: k + 1], skip_special_tokens=False)
            whole = turn_text.startswith(prefix) and not prefix.endswith("\ufffd")
            spans[position] = (start, start + len(prefix) if whole else None)
    return text, spans


def align_offsets(text: str, mask: np.ndarray, spans: list[tuple[int, int | None]],
                  teacher_offsets: list[tuple[int, int]]) -> TeacherRendering:
    """Pair the sampled tokens with teacher tokens by character spans (chunks as in `alignment`)."""
    ends = {b for _, b in teacher_offsets}
    rendering = TeacherRendering([], sampled=int((np.asarray(mask) > 0).sum()))
    for turn in sampled_turns(mask):
        chunk: list[int] = []
        chunk_start = spans[turn[0]][0]
        for position in turn:
            chunk.append(position)
            end = spans[position][1]
            if end is None or end <= chunk_start or end not in ends:
                continue
            if UNREADABLE in text[chunk_start:end]:
                break  # the teacher's history differs from here on (see `alignment.UNREADABLE`)
            teacher = _covering(teacher_offsets, chunk_start, end)
            if teacher:
                rendering.units.append((chunk, teacher))
            chunk, chunk_start = [], end
    return rendering


def post_to_companion(post: Callable[..., Any], url: str, body: dict, timeout: float, *, who: str, role: str,
                      unreachable_hint: str, status_hint: str, timeout_hint: str | None = None) -> Any:
    """POST `body` to another model's endpoint (a teacher's or a judge's) and return its HTTP 200 response. A timeout,
    a transport error or another status is an `InfrastructureFailure` (`<role>_timeout` / `<role>_failed`): such an
    episode is retried, then dropped from its group, never scored."""
    import httpx

    try:
        response = post(url, json=body, timeout=timeout)
    except httpx.TimeoutException as exc:
        raise InfrastructureFailure(f"{who} did not answer within {timeout:g} s ({exc})", cause=f"{role}_timeout",
                                    hint=timeout_hint or unreachable_hint) from None
    except httpx.HTTPError as exc:
        raise InfrastructureFailure(f"{who} failed: {type(exc).__name__}: {exc}", cause=f"{role}_failed",
                                    hint=unreachable_hint) from None
    if response.status_code != 200:
        raise InfrastructureFailure(f"{who} answered HTTP {response.status_code}: {response.text[:300]}",
                                    cause=f"{role}_failed", hint=status_hint)
    return response


class EndpointScorer:
    """A teacher's prompt log-probs from an OpenAI-compatible endpoint (`sdk/run/distillation.py` scores with it)."""

    def __init__(self, spec: str, student_tokenizer: Any, *, timeout: float = TIMEOUT_S, post: Any = None):
        self.url, self.model = parse_endpoint(spec)
        self.tokenizer = student_tokenizer
        self.timeout = timeout
        self._post = post
        self.description = f"the endpoint {self.url} (model {self.model})"

    def prompt_logprobs(self, text: str) -> tuple[list[tuple[int, int]], np.ndarray]:
        """The teacher's tokens of `text` as character spans, and each one's log-prob (the first 0)."""
        import httpx

        body = {"model": self.model, "prompt": text, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 1.0}
        response = post_to_companion(
            self._post or httpx.post, self.url + "/completions", body, self.timeout, who=f"the teacher at {self.url}",
            role="teacher", unreachable_hint="check the teacher's server, then resume",
            status_hint="the endpoint must score prompts: /v1/completions with echo and logprobs")
        try:
            scored = response.json()["choices"][0]["logprobs"]
            offsets, logprobs = list(scored["text_offset"]), list(scored["token_logprobs"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise InfrastructureFailure(f"the teacher at {self.url} returned no prompt log-probs: {response.text[:300]}",
                                        cause="teacher_failed",
                                        hint="the endpoint must answer echo=true with logprobs (vLLM does)") from None
        if len(offsets) != len(logprobs) or not offsets:
            raise InfrastructureFailure(f"the teacher at {self.url} returned {len(offsets)} offsets for "
                                        f"{len(logprobs)} log-probs", cause="teacher_failed")
        # A token ends where the next one starts later; the byte tokens of one multi-byte character all start
        # at it, so they share its span (as `alignment` expects of byte-level offsets).
        starts = sorted({int(o) for o in offsets})
        next_start = dict(zip(starts, [*starts[1:], len(text)]))
        spans = [(int(a), next_start[int(a)]) for a in offsets]
        values = np.asarray([0.0 if v is None else float(v) for v in logprobs], dtype=np.float64)
        if not np.isfinite(values).all():
            raise InfrastructureFailure(f"the teacher at {self.url} returned a non-finite log-prob", cause="teacher_failed")
        return spans, values

    def align(self, tokens: np.ndarray, mask: np.ndarray) -> tuple[TeacherRendering, np.ndarray]:
        """One student sequence scored by the endpoint: its units, and the teacher's log-probs of its tokens."""
        ids = [int(t) for t in np.asarray(tokens)]
        text, spans = student_spans(self.tokenizer, ids, mask)
        teacher_spans, logprobs = self.prompt_logprobs(text)
        return align_offsets(text, mask, spans, teacher_spans), logprobs
