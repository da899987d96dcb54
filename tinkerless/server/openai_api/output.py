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

from tinkerless.server.openai_api.backend import SampledChoice

_WINDOW = 6  # tokens of context decoded with each new one (byte-level BPE merges, leading spaces)


@dataclass
class FinishedChoice:
    pieces: list[str]  # the text each kept token adds (clipped at a stop string; "" for a held-back byte)
    token_ids: list[int]  # the tokens the text and logprobs cover
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    completion_tokens: int  # tokens drawn up to the stop (a stop token included): usage
    finish_reason: str  # "stop" | "length"

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def token_pieces(tokenizer, tokens: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence; "".join(result) is the decoded text."""
    pieces: list[str] = []
    prefix_offset = read_offset = 0
    for i in range(len(tokens)):
        prefix_text = tokenizer.decode(tokens[prefix_offset:read_offset], skip_special_tokens=True)
        new_text = tokenizer.decode(tokens[prefix_offset:i + 1], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            pieces.append(new_text[len(prefix_text):])
            prefix_offset, read_offset = max(read_offset, i + 1 - _WINDOW), i + 1
        else:
            pieces.append("")
    if read_offset < len(tokens):  # an incomplete character at the very end: emit what it decodes to
        prefix_text = tokenizer.decode(tokens[prefix_offset:read_offset], skip_special_tokens=True)
        rest = tokenizer.decode(tokens[prefix_offset:], skip_special_tokens=True)
        pieces[-1] += rest[len(prefix_text):]
    return pieces


def finish(tokenizer, choice: SampledChoice, stop_strings: list[str], stop_token_ids: list[int]) -> FinishedChoice:
    tokens = list(choice.token_ids)
    ended_by_token = choice.stopped and bool(tokens) and tokens[-1] in stop_token_ids
    drawn = len(tokens)
    if ended_by_token:
        tokens = tokens[:-1]
    pieces = token_pieces(tokenizer, tokens)
    reason = "stop" if choice.stopped else "length"
    if stop_strings:
        longest = max(len(s) for s in stop_strings)
        text = ""
        for k, piece in enumerate(pieces):
            searched_from = max(0, len(text) - longest + 1)
            text += piece
            found = [i for i in (text.find(s, searched_from) for s in stop_strings) if i >= 0]
            if found:
                cut, position, kept = min(found), 0, []
                for piece in pieces[:k + 1]:  # every piece clipped to the text before the stop string
                    kept.append(piece[: max(0, cut - position)])
                    position += len(piece)
                pieces, tokens, drawn, reason = kept, tokens[:k + 1], k + 1, "stop"
                break
    top = choice.top_logprobs[: len(tokens)] if choice.top_logprobs is not None else None
    return FinishedChoice(pieces, tokens, list(choice.logprobs[: len(tokens)]), top, drawn, reason)


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
