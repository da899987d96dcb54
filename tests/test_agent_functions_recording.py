"""Recorded completion calls -> training sequences, token by token (no model: the recorder is pure)."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerless.functions.rollout.recording import EpisodeRecorder, RecordedCall, to_sequences

END = 2  # the end-of-turn token of these made-up prompts


def test_calls_that_extend_each_other_form_one_sequence_with_glue_masked():
    calls = [
        RecordedCall([10, 11, 12], [20, 21, END], [-0.1, -0.2, -0.3], (END,)),
        # previous prompt + completion, then glue and a tool result (30, 31), then the next turn's header (12)
        RecordedCall([10, 11, 12, 20, 21, END, 30, 31, 12], [40, END], [-0.4, -0.5], (END,)),
        RecordedCall([10, 11, 12, 20, 21, END, 30, 31, 12, 40, END, 50, 12], [60], [-0.6], (END,)),
    ]
    (sequence,) = to_sequences(calls)
    assert sequence.tokens == [10, 11, 12, 20, 21, END, 30, 31, 12, 40, END, 50, 12, 60]
    assert sequence.mask == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1]
    assert sequence.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3, 0, 0, 0, -0.4, -0.5, 0, 0, -0.6])
    assert sequence.prompt_length == 3 and sequence.calls == 3


def test_a_rewritten_context_starts_a_new_sequence():
    calls = [
        RecordedCall([10, 11], [20, END], [-1.0, -2.0]),
        RecordedCall([10, 11, 20, END, 30], [21], [-3.0]),  # extends: same sequence
        RecordedCall([10, 99, 30], [22, 23], [-4.0, -5.0]),  # the agent summarized its context: a new one
        RecordedCall([10, 99, 30, 22, 23, 7], [24], [-6.0]),  # extends the new one
        RecordedCall([10, 11, 20], [25], [-7.0]),  # a prefix of an earlier prompt is not an extension: new
    ]
    first, second, third = to_sequences(calls)
    assert (first.tokens, first.mask) == ([10, 11, 20, END, 30, 21], [0, 0, 1, 1, 0, 1])
    assert first.logprobs == pytest.approx([0, 0, -1, -2, 0, -3])
    assert (second.tokens, second.mask) == ([10, 99, 30, 22, 23, 7, 24], [0, 0, 0, 1, 1, 0, 1])
    assert second.logprobs == pytest.approx([0, 0, 0, -4, -5, 0, -6])
    assert second.prompt_length == 3
    assert (third.tokens, third.mask, third.prompt_length) == ([10, 11, 20, 25], [0, 0, 0, 1], 3)
    wire = third.as_wire()
    assert wire.tokens.dtype == np.int32 and wire.mask.dtype == np.float32 and wire.sampler_logprobs.dtype == np.float32


def test_an_empty_completion_and_a_prompt_equal_to_the_last_context_still_chain():
    calls = [RecordedCall([1, 2], [], []), RecordedCall([1, 2], [3], [-0.5])]
    (sequence,) = to_sequences(calls)
    assert sequence.tokens == [1, 2, 3] and sequence.mask == [0, 0, 1]


def _same_text(table: dict[int, str]):
    def same(rendered, sampled, stops):
        return "".join(table[t] for t in rendered) == "".join(table[t] for t in sampled)
    return same


def test_a_reply_sent_back_unchanged_but_tokenized_differently_is_replaced_by_the_sampled_ids():
    # token 20 = "ab", tokens 21 22 = "a" "b": the same text, two tokenizations (BPE is not unique)
    table = {20: "ab", 21: "a", 22: "b", 23: "c"}
    recorder = EpisodeRecorder(_same_text(table))
    recorder.record([10, 11], [20, 23, END], [-1.0, -2.0, -3.0], [END])
    rendered = [10, 11, 21, 22, 23, END, 5, 30, 12]  # the router re-rendered the reply as "a" "b" "c"
    prompt = recorder.prompt_for(rendered)
    assert prompt == [10, 11, 20, 23, END, 5, 30, 12]
    recorder.record(prompt, [40], [-4.0], [END])
    (sequence,) = recorder.sequences()
    assert sequence.tokens == [10, 11, 20, 23, END, 5, 30, 12, 40]
    assert sequence.mask == [0, 0, 1, 1, 1, 0, 0, 0, 1]
    assert sequence.logprobs == pytest.approx([0, 0, -1, -2, -3, 0, 0, 0, -4])
    assert recorder.spliced == 1


def test_a_reply_cut_by_max_tokens_keeps_the_templates_end_token_as_glue():
    table = {20: "ab", 21: "a", 22: "b"}
    recorder = EpisodeRecorder(_same_text(table))
    recorder.record([10], [20], [-1.0], [END])  # no end-of-turn drawn: cut by max_tokens
    prompt = recorder.prompt_for([10, 21, 22, END, 7])
    assert prompt == [10, 20, END, 7]
    recorder.record(prompt, [8], [-2.0], [END])
    (sequence,) = recorder.sequences()
    assert sequence.mask == [0, 1, 0, 0, 1]


def test_an_edited_reply_is_a_rewritten_context_not_spliced():
    table = {20: "ab", 21: "a", 22: "b", 23: "x"}
    recorder = EpisodeRecorder(_same_text(table))
    recorder.record([10], [20, END], [-1.0, -2.0], [END])
    edited = [10, 21, 23, END, 7]  # the agent changed its reply from "ab" to "ax"
    assert recorder.prompt_for(edited) == edited
    recorder.record(edited, [8], [-3.0], [END])
    first, second = recorder.sequences()
    assert first.tokens == [10, 20, END] and first.mask == [0, 1, 1]
    assert second.tokens == [10, 21, 23, END, 7, 8] and second.mask == [0, 0, 0, 0, 0, 1]
    assert recorder.spliced == 0


def test_the_recorder_refuses_tokens_without_their_logprobs():
    with pytest.raises(ValueError):
        EpisodeRecorder().record([1], [2, 3], [-1.0])
