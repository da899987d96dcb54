"""Recorded completion calls -> training sequences, token by token (no model: the recorder is pure), the token
proof, and (with the shared tiny worker) the policy version each sampled token carries, checked at the update."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerless.functions.rollout.recording import EpisodeRecorder, RecordedCall, TokenProofError, prove_tokens, to_sequences

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


def _arrays(sequences):
    return [(np.asarray(s.tokens), np.asarray(s.mask), np.asarray(s.logprobs, dtype=np.float32)) for s in sequences]


PROOF_CALLS = [
    RecordedCall([10, 11, 12], [20, 21, END], [-0.1, -0.2, -0.3], (END,)),
    RecordedCall([10, 11, 12, 20, 21, END, 30, 31, 12], [40, END], [-0.4, -0.5], (END,)),
    RecordedCall([10, 99], [], []),  # an empty reply, in a new sequence
    RecordedCall([10, 99, 5], [50], [-0.6], (END,)),
]


def test_the_token_proof_holds_for_what_the_recorder_builds():
    for end in range(1, len(PROOF_CALLS) + 1):
        sequences = to_sequences(PROOF_CALLS[:end])
        prove_tokens(PROOF_CALLS[:end], _arrays(sequences), [s.spans for s in sequences])


@pytest.mark.parametrize("corrupt, says", [
    (lambda a: a[0][0].__setitem__(3, 21), "not the tokens the sampler produced"),  # a sampled token swapped
    (lambda a: a[0][1].__setitem__(4, 0.0), "mask 0"),  # a sampled token left untrained
    (lambda a: a[0][1].__setitem__(6, 1.0), "outside the sampled spans"),  # glue trained as if sampled
    (lambda a: a[1][2].__setitem__(3, -9.0), "log-probs"),  # another distribution's log-prob
    (lambda a: a.pop(), "sequences but spans"),  # a sequence dropped
])
def test_a_corrupted_record_is_refused(corrupt, says):
    sequences = to_sequences(PROOF_CALLS)
    arrays = [tuple(x.copy() for x in a) for a in _arrays(sequences)]
    corrupt(arrays)
    with pytest.raises(TokenProofError, match=says):
        prove_tokens(PROOF_CALLS, arrays, [s.spans for s in sequences])
    with pytest.raises(TokenProofError, match="2 are in the training"):  # a call missing from the sequences
        prove_tokens(PROOF_CALLS, _arrays(sequences[:1]), [sequences[0].spans])


def test_an_episode_whose_arrays_fail_the_proof_is_refused_not_trained():
    from tinkerless.functions.hosting.agent_functions import proven
    from tinkerless.wire.messages import Episode

    (sequence,) = to_sequences(PROOF_CALLS[:2])
    tokens = np.asarray(sequence.tokens, dtype=np.int32)
    good = Episode(task_index=0, tokens=tokens, mask=np.asarray(sequence.mask, np.float32),
                   sampler_logprobs=np.asarray(sequence.logprobs, np.float32), prompt_length=3, reward=1.0)
    assert proven(good, PROOF_CALLS[:2], [sequence.spans]).status == "ok"
    tokens = tokens.copy()
    tokens[-1] = 7  # the update would train a token the sampler never drew
    bad = Episode(task_index=0, tokens=tokens, mask=good.mask, sampler_logprobs=good.sampler_logprobs,
                  prompt_length=3, reward=1.0)
    refused = proven(bad, PROOF_CALLS[:2], [sequence.spans])
    assert refused.status == "error" and np.isnan(refused.reward) and "token proof failed" in refused.error


def test_every_earlier_reply_is_handed_back_not_only_the_last():
    table = {20: "ab", 21: "a", 22: "b", 23: "c", 24: "cd", 25: "d"}
    recorder = EpisodeRecorder(_same_text(table))
    recorder.record([10], [20, END], [-1.0, -2.0], [END])
    recorder.record(recorder.prompt_for([10, 21, 22, END, 7]), [24, END], [-3.0, -4.0], [END])
    # The agent rebuilt its history: both replies re-rendered ("a" "b", "c" "d").
    prompt = recorder.prompt_for([10, 21, 22, END, 7, 23, 25, END, 8])
    assert prompt == [10, 20, END, 7, 24, END, 8] and recorder.spliced == 3 and recorder.drift_turns == 2
    recorder.record(prompt, [9], [-5.0], [END])
    (sequence,) = recorder.sequences()
    assert sequence.mask == [0, 1, 1, 0, 1, 1, 0, 1]


def test_each_sampled_token_carries_its_policy_version_and_the_update_checks_the_staleness_bound(worker):
    from tinkerless.functions.rollout.recording import StaleTokensError
    from tinkerless.wire.messages import (AdamParams, CreatePolicyRequest, Datum, EpisodeLimits, LoraConfig,
                                          RolloutRequest, SamplingParams, UpdateRequest)
    from tinkerless.wire import pack_code
    import tinkerless

    @tinkerless.reward
    def length(completion, task):
        return float(len(completion))

    worker.create_policy(CreatePolicyRequest("versioned", LoraConfig(rank=4, seed=1)))
    request = RolloutRequest(policy="versioned", tasks=[{"prompt": "hi"}], group_size=2,
                             sampling=SamplingParams(max_tokens=4), limits=EpisodeLimits(), seed=0,
                             reward=pack_code(length))
    episodes = worker.rollout(request).episodes
    for episode in episodes:
        mask = np.asarray(episode.mask) > 0
        assert (episode.sampled_versions[mask] == 0).all() and (episode.sampled_versions[~mask] == -1).all()

    def data():
        return [Datum(e.tokens, e.mask, advantages=e.mask * sign, sampler_logprobs=e.sampler_logprobs,
                      sampled_versions=e.sampled_versions) for e, sign in zip(episodes, (1.0, -1.0))]

    adam = AdamParams(learning_rate=1e-3)
    assert worker.update(UpdateRequest("versioned", data(), tinkerless.LossConfig(), adam, max_staleness=0)).policy_version == 1
    # The same tokens again: sampled by version 0, the policy is at 1. Refused in sync mode, taken within a bound of 1.
    with pytest.raises(StaleTokensError, match="version 0, but the policy is at version 1 and max_staleness=0"):
        worker.update(UpdateRequest("versioned", data(), tinkerless.LossConfig(), adam, max_staleness=0))
    assert worker.update(UpdateRequest("versioned", data(), tinkerless.LossConfig(), adam, max_staleness=1)).policy_version == 2
    with pytest.raises(StaleTokensError):
        worker.update(UpdateRequest("versioned", data(), tinkerless.LossConfig(), adam, max_staleness=1))
    # A newer rollout is stamped with the new version.
    assert int(worker.rollout(request).episodes[0].sampled_versions.max()) == 2
