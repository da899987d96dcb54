"""Streamed text of the OpenAI routes, token by token, against the non-streamed path (no server).

`ChoiceText` (streaming.py) must send, for any tokens and stop strings, deltas that concatenate to exactly
what `output.finish` gives the whole generation, with the same tokens, logprobs and usage; `PieceDecoder`
must never put a U+FFFD in a piece for a character split across tokens. The tokenizer is the tiny model's
byte-level one, so multi-byte characters really are split across tokens.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tinkerless.functions.sampling.token_stream import TokenEvent
from tinkerless.functions.openai_api.backend import SampledChoice
from tinkerless.functions.openai_api.output import PieceDecoder, StopScanner, finish, token_pieces
from tinkerless.functions.openai_api.render import chat_format, parse_tool_calls
from tinkerless.functions.openai_api.replies import ChatReply
from tinkerless.functions.openai_api.schemas import ChatCompletionRequest
from tinkerless.functions.openai_api.streaming import ChoiceText, _replayed, chat_chunks

ALPHABET = list("ab cé€😀中\n<>/_{}\":tolcaSTOP")
TEXT = st.text(alphabet=st.sampled_from(ALPHABET), max_size=24)
SLOW = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stream_choice(tokenizer, tokens, logprobs, stop_strings, stop_ids, stopped, *, hold_tool_calls=False):
    """Feed `tokens` to a ChoiceText as the engine would; (deltas, released ranges, the ChoiceText)."""
    text = ChoiceText(tokenizer, stop_strings, stop_ids, top_logprobs=False, hold_tool_calls=hold_tool_calls)
    deltas, ranges = [], []
    for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
        last = i == len(tokens) - 1
        text.add(TokenEvent(0, token, logprob, None, ("stop" if stopped else "length") if last else None))
        delta, start, end = text.take()
        deltas.append(delta)
        ranges.append((start, end))
        if text.done:
            break
    return deltas, ranges, text


@SLOW
@given(TEXT)
def test_pieces_join_to_the_decoded_text_and_never_hold_a_broken_character(tokenizer, text):
    tokens = encode(tokenizer, text)
    pieces = token_pieces(tokenizer, tokens)
    assert "".join(pieces) == tokenizer.decode(tokens, skip_special_tokens=True) == text
    assert not any("\ufffd" in piece for piece in pieces)


@SLOW
@given(st.lists(st.integers(0, 255), max_size=16))
def test_pieces_of_any_byte_tokens_join_to_the_decoded_text(tokenizer, raw):
    """Arbitrary byte tokens, invalid UTF-8 included: the pieces still join to what decoding the whole gives."""
    tokens = [tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(b)) for b in raw]
    decoder = PieceDecoder(tokenizer)
    pieces = [decoder.add(t) for t in tokens]
    assert "".join(pieces) + decoder.flush() == tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_split_character_arrives_whole_in_one_delta(tokenizer):
    tokens = encode(tokenizer, "a😀b")
    assert len(tokens) == 6  # byte-level: the emoji is four tokens
    deltas, _, text = stream_choice(tokenizer, tokens, [0.0] * 6, [], [], False)
    assert deltas == ["a", "", "", "", "😀", "b"] and text.reason == "length"


@SLOW
@given(TEXT, st.lists(TEXT.filter(bool), max_size=3), st.booleans(), st.booleans())
def test_streamed_choice_equals_the_finished_one(tokenizer, text, stops, ends_with_eos, pick_stop_from_text):
    eos = chat_format(tokenizer).eos_token_ids
    if pick_stop_from_text and len(text) > 2:  # a stop string that is really there, likely spanning tokens
        stops = stops + [text[len(text) // 3: len(text) // 3 + 2]]
    tokens = encode(tokenizer, text) + ([eos[0]] if ends_with_eos else [])
    if not tokens:
        return
    logprobs = [-0.01 * (i + 1) for i in range(len(tokens))]
    whole = finish(tokenizer, SampledChoice(tokens, logprobs, None, ends_with_eos), stops, eos)
    deltas, ranges, streamed = stream_choice(tokenizer, tokens, logprobs, stops, eos, ends_with_eos)
    got = streamed.finished()
    assert "".join(deltas) == whole.text
    assert (got.token_ids, got.logprobs, got.completion_tokens, got.finish_reason, got.pieces) == \
        (whole.token_ids, whole.logprobs, whole.completion_tokens, whole.finish_reason, whole.pieces)
    # Each kept token's logprobs are sent exactly once, in order, with (or after) the text it completes.
    assert [i for start, end in ranges for i in range(start, end)] == list(range(len(whole.token_ids)))
    sent = 0
    for delta, (start, end) in zip(deltas, ranges):
        sent += len(delta)
        assert sum(len(p) for p in whole.pieces[:end]) <= sent


def test_text_that_may_start_a_stop_string_is_held_until_decided(tokenizer):
    tokens = encode(tokenizer, "abcSTab")
    deltas, _, text = stream_choice(tokenizer, tokens, [0.0] * len(tokens), ["STOP"], [], False)
    # "S", "ST" could begin "STOP": held; "STa" cannot: released with the next token.
    assert deltas == ["a", "b", "c", "", "", "STa", "b"]
    tokens = encode(tokenizer, "abSTOPcd")
    deltas, _, text = stream_choice(tokenizer, tokens, [0.0] * len(tokens), ["STOP"], [], False)
    assert deltas == ["a", "b", "", "", "", ""] and text.reason == "stop" and text.drawn == 6


def test_stop_scanner_stable_prefix():
    scanner = StopScanner(["</end>", "xyz"])
    scanner.add("hello </e")
    assert scanner.text[: scanner.stable()] == "hello "
    scanner.add("x")
    assert scanner.text[: scanner.stable()] == "hello </e"  # "x" may begin "xyz"
    assert scanner.add("yz") and scanner.text[: scanner.cut] == "hello </e"


def stream_chat(tokenizer, text: str, *, tools: bool) -> tuple[list[dict], list[dict]]:
    """The chunks of a one-choice chat reply that drew `text` then the end-of-turn token, and the full reply."""
    eos = chat_format(tokenizer).eos_token_ids
    tokens = encode(tokenizer, text) + [eos[0]]
    choice = SampledChoice(tokens, [-0.5] * len(tokens), None, True)
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True, "logprobs": True})
    reply = ChatReply(body, tokenizer, 3, parse_tools=tools)
    texts = [ChoiceText(tokenizer, [], eos, top_logprobs=False, hold_tool_calls=tools)]

    async def collect() -> list[dict]:
        return [chunk async for chunk in chat_chunks(reply, [_replayed([choice])], texts)]

    return asyncio.run(collect()), reply.full([finish(tokenizer, choice, [], eos)])["choices"]


@pytest.mark.parametrize("text", [
    'Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>\n'
    '<TOOL_CALL>{"name": "search", "arguments": {"q": "é€"}}</TOOL_CALL>',
    "No call here, but a < sign and <tool_ca... text",
])
def test_tool_calls_arrive_at_the_end_parsed_like_the_full_reply(tokenizer, text):
    chunks, full = stream_chat(tokenizer, text, tools=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    expected_content, expected_calls = parse_tool_calls(text)
    assert content == (expected_content or "") == (full[0]["message"]["content"] or "")
    assert "tool_call" not in content.lower() or not expected_calls
    assert [(c["index"], c["function"]) for c in calls] == [(j, c["function"]) for j, c in enumerate(expected_calls)]
    assert chunks[-1]["choices"][0]["finish_reason"] == full[0]["finish_reason"]
    # Logprobs: one entry per token of the reply (the end-of-turn token excluded), as the full reply's.
    streamed = [e for c in chunks if c["choices"][0]["logprobs"] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == full[0]["logprobs"]["content"]


def test_content_before_a_tool_call_streams_before_the_call_is_done(tokenizer):
    chunks, _ = stream_chat(tokenizer, 'Let me compute. <tool_call>{"name": "c", "arguments": {}}</tool_call>',
                            tools=True)
    contents = [c["choices"][0]["delta"].get("content") for c in chunks]
    first_call = next(i for i, c in enumerate(chunks) if "tool_calls" in c["choices"][0]["delta"])
    assert "".join(x or "" for x in contents[:first_call]) == "Let me compute."
    assert contents.index("L") < first_call - 10  # sent as drawn, long before the call's last token


FRAGMENTS = ["<tool_call>", "< TOOL_CALL >", '{"name": "calc", "arguments": {"x": 1}}', "{bad json", "</tool_call>",
             "Sure", " ", "\n", "<", "<tool", "é€", "😀", "done."]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=8).map("".join))
def test_any_reply_with_tools_streams_the_full_replys_content_and_calls(tokenizer, text):
    if not text:
        return
    chunks, full = stream_chat(tokenizer, text, tools=True)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [call["function"] for d in deltas for call in d.get("tool_calls", [])]
    assert content == (full[0]["message"]["content"] or "")
    assert calls == [call["function"] for call in full[0]["message"].get("tool_calls") or []]
    assert chunks[-1]["choices"][0]["finish_reason"] == full[0]["finish_reason"]
