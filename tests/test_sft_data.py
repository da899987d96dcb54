"""SFT data: rendering with the model's chat template, per-token weights, and every bad-input case."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinkerless.errors import ConfigError, DatasetError
from tinkerless.sdk.sft.data import ChatRenderer, as_records, read_jsonl, render_examples, split_holdout, to_messages


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    from tinkerless.functions.rollout.chat import ChatFormat

    return ChatRenderer(tokenizer, ChatFormat(tokenizer).end_of_turn_id)


def _ids(tokenizer, messages):
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    out = tokenizer.apply_chat_template(plain, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_two_turn_conversation_weighs_assistant_content_and_end_of_turn_token_by_token(tokenizer, renderer):
    # The tiny tokenizer is byte-level (one token per byte, specials whole), so every token is checkable.
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    example = renderer.render(to_messages({"messages": messages}, "t"), "t", 1)
    assert list(example.tokens) == _ids(tokenizer, messages)
    pieces = [tokenizer.decode([t]) for t in example.tokens]
    # ChatML: <|im_start|>role\ncontent<|im_end|>\n per message.
    expected = []
    for m in messages:
        expected += [("<|im_start|>", 0)] + [(c, 0) for c in m["role"] + "\n"]
        trained = int(m["role"] == "assistant")
        expected += [(c, trained) for c in m["content"]] + [("<|im_end|>", trained), ("\n", 0)]
    assert [(p, int(w)) for p, w in zip(pieces, example.weights)] == expected


def test_train_false_turn_is_context_only_and_ids_still_match_the_template(tokenizer, renderer):
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bad reply", "train": False},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "good"},
    ]
    example = renderer.render(to_messages({"messages": messages}, "t"), "t", 1)
    assert list(example.tokens) == _ids(tokenizer, messages)
    trained_text = tokenizer.decode([t for t, w in zip(example.tokens, example.weights) if w])
    assert trained_text == "good<|im_end|>"


def test_prompt_completion_pair_is_one_user_and_one_assistant_turn(tokenizer, renderer):
    pair = to_messages({"prompt": "say x", "completion": "x"}, "t")
    assert [(m["role"], m["content"]) for m in pair] == [("user", "say x"), ("assistant", "x")]
    example = renderer.render(pair, "t", 1)
    assert tokenizer.decode([t for t, w in zip(example.tokens, example.weights) if w]) == "x<|im_end|>"
    listed = to_messages({"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "completion": "c"}, "t")
    assert [m["role"] for m in listed] == ["system", "user", "assistant"]


def test_smollm2_rendering_equals_apply_chat_template():
    """The real model's template (it adds a default system prompt): ids identical, only replies weighted."""
    from transformers import AutoTokenizer

    from tinkerless.functions.rollout.chat import ChatFormat
    from tinkerless.functions.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    renderer = ChatRenderer(tokenizer, ChatFormat(tokenizer).end_of_turn_id)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4."}]
    example = renderer.render(to_messages({"messages": messages}, "t"), "t", 1)
    assert list(example.tokens) == _ids(tokenizer, messages)
    trained = [tokenizer.decode([t]) for t, w in zip(example.tokens, example.weights) if w]
    assert "".join(trained) == "Hello!<|im_end|>It is 4.<|im_end|>"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
        ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "train": false}]}', "every assistant message has 'train': false"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}', "role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}', "no string 'content'"),
        ('{"messages": [{"role": "user", "content": "a", "train": true}, {"role": "assistant", "content": "b"}]}', "only assistant messages are trained"),
        ('{"messages": []}', "non-empty list"),
        ('{"text": "hello"}', "no 'messages'"),
        ('[1, 2]', "expected a JSON object"),
        ('{"prompt": "p", "completion": 5}', "'completion' must be a string"),
    ],
)
def test_bad_examples_name_their_line_and_the_fix(tmp_path, renderer, line, message):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "data.jsonl"
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(DatasetError) as info:
        render_examples(read_jsonl(path), renderer, max_length=1000, source=str(path))
    assert f"{path}, line 3" in str(info.value) and message in str(info.value)
    assert info.value.hint


def test_malformed_json_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a", "completion": \n')
    with pytest.raises(DatasetError, match=r"line 2: not valid JSON"):
        read_jsonl(path)


def test_missing_empty_and_non_list_data_are_refused(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(DatasetError, match="holds no examples"):
        read_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(DatasetError, match="empty"):
        as_records([])
    with pytest.raises(DatasetError, match="JSONL path or a list"):
        as_records(42)


def test_conversation_over_max_length_is_refused_with_its_length(renderer):
    long = {"messages": [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y"}]}
    with pytest.raises(DatasetError, match=r"line 1: the conversation is \d+ tokens, over max_length=100") as info:
        render_examples([(1, long)], renderer, max_length=100, source="data.jsonl")
    assert "raise max_length" in info.value.hint


def test_a_tokenizer_without_chat_template_is_a_config_error(tokenizer):
    import copy

    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(ConfigError, match="no chat template"):
        ChatRenderer(bare, None)


def test_holdout_split_is_seeded_and_disjoint(renderer):
    records = [(i + 1, {"prompt": f"q{i}", "completion": f"a{i}"}) for i in range(20)]
    examples = render_examples(records, renderer, max_length=100, source="d")
    train, held = split_holdout(examples, 0.2, seed=3)
    assert len(held) == 4 and len(train) == 16
    assert {e.line for e in train}.isdisjoint({e.line for e in held})
    assert [e.line for e in split_holdout(examples, 0.2, seed=3)[1]] == [e.line for e in held]
    assert split_holdout(examples, 0.0, seed=3) == (examples, [])
    assert all(isinstance(e.weights, np.ndarray) and e.weights[0] == 0 for e in examples)


@pytest.mark.parametrize("kind", ["word", "calculation"])
def test_generated_calculator_demonstrations_are_correct_episodes_of_the_env(renderer, kind):
    import random

    from tinkerless.envs.calculator import (
        CalculatorEnv,
        make_calculation_problem,
        make_demonstrations,
        make_word_problem,
        solved_calculation_problem,
        solved_word_problem,
    )

    solver, generator = {"word": (solved_word_problem, make_word_problem), "calculation": (solved_calculation_problem, make_calculation_problem)}[kind]
    demos = make_demonstrations(30, seed=4, problems=solver)
    assert demos == make_demonstrations(30, seed=4, problems=solver)  # reproducible
    assert len({d["task"]["question"] for d in demos}) > 25
    env = CalculatorEnv()
    for demo in demos:
        messages = demo["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        assert messages[0]["content"] == env.system_prompt()  # what a rollout shows the model
        assert messages[1]["content"] == CalculatorEnv().reset(**demo["task"])
        # Replayed through a fresh env: a well-formed call whose result is the answer, then the answer.
        replay = CalculatorEnv()
        replay.reset(**demo["task"])
        observation = replay.step(messages[2]["content"])
        assert observation.observation == messages[3]["content"] == f"<tool_response>{demo['task']['answer']}</tool_response>"
        assert replay.step(messages[4]["content"]).reward == 1.0
    # Tasks are exactly what the generator RL trains on makes from the same random state.
    assert [d["task"] for d in demos] == [generator(random.Random(f"demo:4:{i}")) for i in range(30)]
    first = demos[0]["messages"]
    example = renderer.render(to_messages({"messages": first}, "demo"), "demo", 1)
    assert example.trained_tokens == len(first[2]["content"]) + len(first[4]["content"]) + 2  # bytes + 2 <|im_end|>
