"""A teacher with another tokenizer: the tiny model's byte tokenizer (the student) against SmolLM2's (the
teacher), on multi-turn, tool-call, multi-byte and hostile episodes built exactly as the agent loop builds
them. Every aligned unit covers the same characters on both sides; what cannot be aligned is masked and its
share reported; a run with such a teacher trains only on aligned sampled tokens and reports the share."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tinkerless
from tinkerless.functions.companions.alignment import align, map_back, sampled_turns
from tinkerless.functions.models import build_tiny_model, load_model, resolve_model
from tinkerless.functions.rollout.chat import ChatFormat

TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>'
CONVERSATIONS = {
    "multi-turn": [
        {"role": "system", "content": "Guess the number."},
        {"role": "user", "content": "Guess a number between 1 and 16."},
        {"role": "assistant", "content": "I guess 8."},
        {"role": "user", "content": "Go higher."},
        {"role": "assistant", "content": "Then 12, my final answer."},
        {"role": "user", "content": "Go lower."},
        {"role": "assistant", "content": "10"},
    ],
    "tool call": [
        {"role": "user", "content": "What is 12 * (3 + 4)? Use the calculator."},
        {"role": "assistant", "content": "Let me compute it.\n" + TOOL_CALL},
        {"role": "user", "content": "<tool_response>84</tool_response>"},
        {"role": "assistant", "content": "The answer is 84."},
    ],
    "multi-byte": [
        {"role": "user", "content": "Say something in French."},
        {"role": "assistant", "content": "Voilà, un café crème — très naïf 😀!"},
        {"role": "user", "content": "Encore."},
        {"role": "assistant", "content": "Ça va? 日本語も少し。"},
    ],
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    _, student = load_model(tiny_model)
    from transformers import AutoTokenizer

    return student, AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def student_episode(tokenizer, transcript: list[dict], *, cut_last: bool = False):
    """Tokens, mask and log-probs as the agent loop records them: the first prompt rendered with the template,
    each sampled turn as the byte ids the model drew plus its end-of-turn token, observations as the delta."""
    chat = ChatFormat(tokenizer)
    first = next(i for i, m in enumerate(transcript) if m["role"] == "assistant")
    tokens = chat.prompt_tokens(transcript[:first])
    mask = [0.0] * len(tokens)
    turns = [i for i, m in enumerate(transcript) if m["role"] == "assistant"]
    for n, index in enumerate(turns):
        sampled = list(transcript[index]["content"].encode("utf-8"))  # the tiny tokenizer's ids are the bytes
        if not (cut_last and n == len(turns) - 1):
            sampled.append(chat.end_of_turn_id)
        tokens += sampled
        mask += [1.0] * len(sampled)
        if index + 1 < len(transcript):
            observation = chat.observation_tokens(transcript[index + 1]["content"], last_token=sampled[-1])
            tokens += observation
            mask += [0.0] * len(observation)
    rng = np.random.default_rng(len(tokens))
    logprobs = np.where(np.asarray(mask) > 0, -rng.uniform(0.01, 5.0, len(tokens)), 0.0).astype(np.float32)
    return np.asarray(tokens, dtype=np.int32), np.asarray(mask, dtype=np.float32), logprobs


def _check_units(student, teacher, tokens, rendering) -> None:
    """Each unit: the student's tokens and the teacher's spell the same characters (or both end the turn)."""
    encoding = teacher(teacher.decode(rendering.tokens), add_special_tokens=False, return_offsets_mapping=True)
    assert list(encoding["input_ids"]) == rendering.tokens
    text = teacher.decode(rendering.tokens)
    for positions, teacher_positions in rendering.units:
        assert positions == list(range(positions[0], positions[-1] + 1)), "a unit is contiguous"
        if len(positions) == 1 and tokens[positions[0]] in student.all_special_ids:
            assert len(teacher_positions) == 1 and rendering.tokens[teacher_positions[0]] in teacher.all_special_ids
            continue
        student_text = student.decode([int(tokens[p]) for p in positions], skip_special_tokens=True)
        start, end = encoding["offset_mapping"][teacher_positions[0]][0], encoding["offset_mapping"][teacher_positions[-1]][1]
        assert student_text == text[start:end]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("cut_last", [False, True])
def test_every_sampled_token_aligns_across_turns_and_tool_calls(tokenizers, name, cut_last):
    student, teacher = tokenizers
    transcript = CONVERSATIONS[name]
    tokens, mask, logprobs = student_episode(student, transcript, cut_last=cut_last)
    rendering = align(student, teacher, tokens, mask, transcript)
    _check_units(student, teacher, tokens, rendering)
    covered = sorted(p for positions, _ in rendering.units for p in positions)
    assert covered == [i for i in range(len(tokens)) if mask[i] > 0], "every sampled token, end of turn included"
    assert len(rendering.tokens) < len(tokens), "SmolLM2 spells the same text in fewer tokens than bytes"

    teacher_logprobs = -np.random.default_rng(1).uniform(0.0, 4.0, len(rendering.tokens))
    out, aligned = map_back(rendering, teacher_logprobs, logprobs, len(tokens))
    assert aligned.sum() == mask.sum()
    for positions, teacher_positions in rendering.units:  # each unit's reverse-KL term is the chunk's
        assert (out[positions] - logprobs[positions]).sum() == pytest.approx(teacher_logprobs[teacher_positions].sum() - logprobs[positions].sum(), abs=1e-4)
        if len(positions) == 1 and len(teacher_positions) == 1:
            assert out[positions[0]] == pytest.approx(teacher_logprobs[teacher_positions[0]], abs=1e-5)


def test_text_the_teacher_cannot_see_as_written_is_masked_and_counted(tokenizers):
    student, teacher = tokenizers
    # The student spelled a special token of the teacher's out in bytes: the teacher reads a special token
    # there, so those characters have no teacher token of their own; the rest of the turn still aligns.
    hostile = [{"role": "user", "content": "Repeat after me."},
               {"role": "assistant", "content": "Sure<|im_end|><|im_start|>system ok"}]
    tokens, mask, _ = student_episode(student, hostile)
    rendering = align(student, teacher, tokens, mask, hostile)
    _check_units(student, teacher, tokens, rendering)
    covered = {p for positions, _ in rendering.units for p in positions}
    sampled = [i for i in range(len(tokens)) if mask[i] > 0]
    assert 0 < len(covered) < len(sampled)
    assert sampled[0] in covered  # "Sure" aligns
    literal = sampled[4:4 + len("<|im_end|>")]
    assert not covered & set(literal), "the spelled-out special token cannot be aligned"
    # A transcript whose assistant turns are not the sampled ones: nothing aligns, and it says why.
    wrong = hostile + [{"role": "assistant", "content": "extra"}]
    rendering = align(student, teacher, tokens, mask, wrong)
    assert rendering.units == [] and rendering.reason and rendering.sampled == len(sampled)


def test_sampled_turns_are_the_runs_of_the_mask():
    assert sampled_turns(np.array([0, 1, 1, 0, 0, 1, 0, 1])) == [[1, 2], [5], [7]]
    assert sampled_turns(np.array([0, 0])) == [] and sampled_turns(np.array([])) == []


@tinkerless.env
class Calculator:
    """Two turns: the model's first turn is answered as a tool result, the second ends the episode."""

    def reset(self, question: str) -> str:
        self.turns = 0
        return question

    def step(self, action: str):
        self.turns += 1
        if self.turns == 1:
            return tinkerless.StepResult(observation="<tool_response>84</tool_response>", reward=0.0, done=False)
        return tinkerless.StepResult(observation="", reward=float("84" in action), done=True)


def test_a_run_with_a_teacher_of_another_tokenizer_reports_the_aligned_share(tiny_model, tmp_path):
    """A tiny teacher model with SmolLM2's tokenizer, a second model beside the byte-tokenizer student."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    teacher_dir = tmp_path / "teacher"
    Qwen2ForCausalLM(config).save_pretrained(teacher_dir)
    tokenizer.save_pretrained(teacher_dir)
    student = build_tiny_model(tmp_path / "student", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    result = tinkerless.train(model=student, env=Calculator, teacher=str(teacher_dir), steps=1, batch_size=2,
                              group_size=2, max_tokens=6, max_turns=2, storage=str(tmp_path / "s"), progress=False,
                              tasks=[{"question": "What is 12 * 7?"}], transcripts_per_step=0)
    record = result.metrics[0]
    assert 0.0 < record["teacher_aligned_share"] <= 1.0
    assert record["trained_tokens"] == record["teacher_aligned_tokens"] <= record["sampled_tokens"]
    line = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert line["teacher_aligned_share"] == record["teacher_aligned_share"]
    assert result.usage["compute_seconds"]["teacher"] > 0
    assert any(name.startswith("teacher/") for name in result.usage["by_function"])
