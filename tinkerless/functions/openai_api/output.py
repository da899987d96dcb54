"""Sampled token ids to OpenAI response pieces: text deltas, stop-string truncation, logprobs, finish reasons.

Text is decoded incrementally (a few tokens of context per step, holding back a token that ends in
the middle of a UTF-8 character), so the streamed deltas concatenate to exactly the non-streamed
text and every token's text offset is known.

Stop strings follow the OpenAI semantics: generation is checked after every token; the first token
after which the text contains a stop string ends the choice, and the text is cut right before that
stop string (it is not returned). The tokens up to and including that one are what the choice drew:
they are counted in `usage` and listed in `logprobs`. A stop *token* (the template's end of turn) is
counted in `usage` but is not part of the text or the logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinkerless.functions.openai_api.backend import SampledChoice

_WINDOW = 6  # tokens of context decoded with each new one (byte-level BPE merges, leading spaces)


@dataclass
class FinishedChoice:
    pieces: list[str]  # the text each kept token adds (clipped at a stop string; "" for a held-back byte)
    token_ids: list[int]  # the tokens the text and logprobs cover
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    completion_tokens: int  # tokens drawn up to the stop (a stop token included): usage
    finish_reason: str  # "stop" | "length"
    stop_string: str | None = None  # the stop string that ended the text, if one did (Anthropic's stop_sequence)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class PieceDecoder:
    """Incremental detokenization: `add(token)` is the text that token adds to the decoded sequence, "" while it
    ends in the middle of a UTF-8 character (held back until the character completes), so no piece holds a
    U+FFFD that the whole text would not. `flush()` is what an incomplete character at the very end decodes to."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = self._read = 0  # tokens[_prefix:_read]: the context decoded with each new token

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def add(self, token: int) -> str:
        self.tokens.append(token)
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = max(self._read, len(self.tokens) - _WINDOW), len(self.tokens)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        if self._read >= len(self.tokens):
            return ""
        rest = self._decode(self._prefix)[len(self._decode(self._prefix, self._read)):]
        self._read = len(self.tokens)
        return rest


def token_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence; "".join(result) is the decoded text."""
    decoder = PieceDecoder(tokenizer)
    pieces = [decoder.add(token) for token in tokens]
    if pieces:
        pieces[-1] += decoder.flush()
    return pieces


class StopScanner:
    """OpenAI stop strings over text that grows piece by piece: `add(piece)` is True once the text holds a stop
    string (`cut` is then where the first one starts: the text ends there); `stable()` is how much of the text
    no later piece can turn into the start of a stop string (what a stream may send now)."""

    def __init__(self, stop_strings: list[str]):
        self.stops = [s for s in stop_strings if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.cut: int | None = None
        self.matched: str | None = None  # the stop string found at `cut`

    def add(self, piece: str) -> bool:
        if self.cut is not None:
            return True
        searched_from = max(0, len(self.text) - self.longest + 1)  # earlier matches were found at earlier pieces
        self.text += piece
        found = [(i, s) for i, s in ((self.text.find(s, searched_from), s) for s in self.stops) if i >= 0]
        if found:
            self.cut, self.matched = min(found, key=lambda match: match[0])
        return self.cut is not None

    def stable(self) -> int:
        if self.cut is not None:
            return self.cut
        for length in range(min(len(self.text), self.longest - 1), 0, -1):  # the longest tail a stop string starts with
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self.stops):
                return len(self.text) - length
        return len(self.text)


def clip_pieces(pieces: list[str], cut: int) -> list[str]:
    """Every piece clipped to the text before position `cut`."""
    kept, position = [], 0
    for piece in pieces:
        kept.append(piece[: max(0, cut - position)])
        position += len(piece)
    return kept


def finish(tokenizer, choice: SampledChoice, stop_strings: list[str], stop_token_ids: list[int]) -> FinishedChoice:
    tokens = list(choice.token_ids)
    ended_by_token = choice.stopped and bool(tokens) and tokens[-1] in stop_token_ids
    drawn = len(tokens)
    if ended_by_token:
        tokens = tokens[:-1]
    pieces = token_pieces(tokenizer, tokens)
    reason = "stop" if choice.stopped else "length"
    scanner = StopScanner(stop_strings)
    for k, piece in enumerate(pieces):
        if scanner.add(piece):
            pieces, tokens, drawn, reason = clip_pieces(pieces[:k + 1], scanner.cut), tokens[:k + 1], k + 1, "stop"
            break
    top = choice.top_logprobs[: len(tokens)] if choice.top_logprobs is not None else None
    return FinishedChoice(pieces, tokens, list(choice.logprobs[: len(tokens)]), top, drawn, reason, scanner.matched)


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(tokenizer, finished: FinishedChoice, start: int = 0, end: int | None = None) -> dict:
    """The chat `logprobs` object ({"content": [...]}) for kept tokens start..end."""
    end = len(finished.token_ids) if end is None else end
    content = []
    for i in range(start, end):
        text = token_text(tokenizer, finished.token_ids[i])
        alternatives = finished.top_logprobs[i] if finished.top_logprobs is not None else []
        content.append({
            "token": text, "logprob": finished.logprobs[i], "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {"token": (alt := token_text(tokenizer, t)), "logprob": lp, "bytes": list(alt.encode("utf-8"))}
                for t, lp in alternatives
            ],
        })
    return {"content": content}


def completion_logprobs(tokenizer, finished: FinishedChoice, start: int = 0, end: int | None = None,
                        offset: int = 0) -> dict:
    """The legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset)."""
    end = len(finished.token_ids) if end is None else end
    offsets, position = [], offset
    for piece in finished.pieces[start:end]:
        offsets.append(position)
        position += len(piece)
    top = None
    if finished.top_logprobs is not None:
        top = [{token_text(tokenizer, t): lp for t, lp in finished.top_logprobs[i]} for i in range(start, end)]
    return {
        "tokens": [token_text(tokenizer, t) for t in finished.token_ids[start:end]],
        "token_logprobs": finished.logprobs[start:end],
        "top_logprobs": top,
        "text_offset": offsets,
    }
