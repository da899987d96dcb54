"""Multi-turn contexts equal `apply_chat_template` of the same messages, token by token.

A turn the model ended itself (it sampled the end-of-turn token) and a turn cut at
max_tokens must both leave a well-formed chat context: on the tiny model, on SmolLM2
(slow), and through the real agent loop (the token ids the episode trains on).
A model whose end of turn cannot be determined is refused with a clear error.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tinkerless
from tinkerless.errors import ConfigError
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.models import load_model
from tinkerless.functions.worker import Worker
from tinkerless.wire import pack_code
from tinkerless.wire.messages import CreatePolicyRequest, EpisodeLimits, RolloutRequest, SamplingParams

_REPLY_ENDED = "The answer is 12."
_REPLY_CUT = "Let me think about this step by step, because"
_REPLY_LAST = "Done."
_MESSAGES = [
    {"role": "system", "content": "You play a counting game."},
    {"role": "user", "content": "Count from 10."},
    {"role": "assistant", "content": _REPLY_ENDED},
    {"role": "user", "content": "Wrong, try again: 11?"},
    {"role": "assistant", "content": _REPLY_CUT},
    {"role": "user", "content": "Too long. Answer in one word."},
    {"role": "assistant", "content": _REPLY_LAST},
]


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_and_tokenizer(request, tiny_model):
    return load_model(tiny_model if request.param == "tiny" else "smollm2")


def _template_tokens(tokenizer, messages, *, add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def test_three_turn_episode_renders_as_the_chat_template(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    chat = ChatFormat(tokenizer, model.generation_config)
    end = chat.end_of_turn_id
    assert tokenizer.convert_ids_to_tokens(end) == "<|im_end|>"

    context = chat.prompt_tokens(_MESSAGES[:2])
    ended = chat.encode(_REPLY_ENDED) + [end]  # the model sampled its end-of-turn token
    context += ended + chat.observation_tokens(_MESSAGES[3]["content"], last_token=ended[-1])
    assert context == _template_tokens(tokenizer, _MESSAGES[:4], add_generation_prompt=True)

    cut = chat.encode(_REPLY_CUT)  # cut at max_tokens: no end-of-turn sampled
    context += cut + chat.observation_tokens(_MESSAGES[5]["content"], last_token=cut[-1])
    assert context == _template_tokens(tokenizer, _MESSAGES[:6], add_generation_prompt=True)

    context += chat.encode(_REPLY_LAST) + [end]
    full = _template_tokens(tokenizer, _MESSAGES, add_generation_prompt=False)
    # The template ends the last turn with end-of-turn and a newline the model never samples.
    assert context == full[: len(context)] and tokenizer.decode(full[len(context) :]) == "\n"


def test_no_doubled_or_wrong_end_of_turn_in_the_rendered_text(model_and_tokenizer):
    """The two malformations of issue #10: `<|im_end|><|im_end|>` and `<|im_start|><|im_end|>`."""
    model, tokenizer = model_and_tokenizer
    chat = ChatFormat(tokenizer, model.generation_config)
    for last in (chat.end_of_turn_id, chat.encode("x")[-1], None):
        text = tokenizer.decode(chat.observation_tokens("obs", last_token=last))
        prefix = "" if last == chat.end_of_turn_id else "<|im_end|>"
        assert text == prefix + "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"


def test_the_tokenizer_eos_is_the_end_of_turn(model_and_tokenizer):
    """Clients (Tinker renderers) read tokenizer.eos_token: it must be the token that ends a turn."""
    model, tokenizer = model_and_tokenizer
    chat = ChatFormat(tokenizer, model.generation_config)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == chat.end_of_turn_id
    assert chat.eos_token_ids == [chat.end_of_turn_id]
    generation_eos = model.generation_config.eos_token_id
    assert (generation_eos if isinstance(generation_eos, int) else generation_eos[0]) == chat.end_of_turn_id


# ---- through the real agent loop ------------------------------------------------------------------------------------


@tinkerless.env
class ThreeQuestions:
    def reset(self, start: int) -> str:
        self.turn = 0
        return f"Count from {start}."

    def step(self, action: str) -> tinkerless.StepResult:
        self.turn += 1
        done = self.turn >= 3
        return tinkerless.StepResult(observation=None if done else f"Next number after turn {self.turn}?", done=done)


def _expected_from_template(tokenizer, chat: ChatFormat, episode) -> list[int]:
    """The template rendered around the episode's own sampled tokens: frame tokens from the template, content as sampled."""
    sampled_turns = _sampled_spans(episode)
    markers = [f"\u2063TURN{i}\u2063" for i in range(len(sampled_turns))]
    messages, turn = [], 0
    for message in episode.transcript:
        if message["role"] == "assistant":
            messages.append({"role": "assistant", "content": markers[turn]})
            turn += 1
        else:
            messages.append(message)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    expected: list[int] = []
    for marker, span in zip(markers, sampled_turns):
        before, text = text.split(marker, 1)
        expected += chat.encode(before)
        closed = span[-1] == chat.end_of_turn_id if span else False
        expected += span[:-1] if closed else span
    # After the last turn the template writes end-of-turn + "\n"; the episode stops at what was sampled.
    return expected + ([chat.end_of_turn_id] if sampled_turns and sampled_turns[-1][-1:] == [chat.end_of_turn_id] else [])


def _sampled_spans(episode) -> list[list[int]]:
    spans, current = [], None
    for token, sampled in zip(episode.tokens.tolist(), episode.mask.tolist()):
        if sampled:
            current = current if current is not None else []
            current.append(token)
        elif current is not None:
            spans.append(current)
            current = None
    if current is not None:
        spans.append(current)
    return spans


@pytest.fixture(scope="module")
def eager_stopper(tiny_model, tmp_path_factory) -> str:
    """The tiny model with a scaled-up end-of-turn embedding: about half its turns end by EOS, half are cut."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("models") / "eager-stopper"
    shutil.copytree(tiny_model, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.get_input_embeddings().weight[tokenizer.eos_token_id] *= 60.0  # tied: the output logit too
    model.save_pretrained(path)
    return str(path)


def test_agent_loop_episode_tokens_equal_the_template_around_the_sampled_tokens(eager_stopper):
    worker = Worker(eager_stopper)
    worker.create_policy(CreatePolicyRequest("chat"))
    request = RolloutRequest(
        policy="chat", tasks=[{"start": 3}, {"start": 7}], group_size=8,
        sampling=SamplingParams(max_tokens=6, temperature=1.0),
        limits=EpisodeLimits(max_turns=3, max_episode_tokens=2048), seed=5, env=pack_code(ThreeQuestions),
    )
    episodes = worker.rollout(request).episodes
    ended = cut = 0
    for episode in episodes:
        assert episode.status == "ok" and episode.num_turns == 3
        spans = _sampled_spans(episode)
        for span in spans[:-1]:
            if span and span[-1] == worker.chat.end_of_turn_id:
                ended += 1
            else:
                cut += 1
        assert episode.tokens.tolist() == _expected_from_template(worker.tokenizer, worker.chat, episode)
    assert ended and cut, f"the test needs both kinds of turn boundary (ended {ended}, cut {cut})"


@pytest.mark.slow
def test_smollm2_agent_loop_matches_apply_chat_template():
    """SmolLM2, greedy: a short answer it ends itself, then a long one cut at max_tokens, against the template."""

    @tinkerless.env
    class Questions:
        def reset(self, first: str) -> str:
            self.turn = 0
            return first

        def step(self, action: str) -> tinkerless.StepResult:
            self.turn += 1
            follow = ["Now write a long essay about the history of Rome.", "Thanks."]
            done = self.turn > len(follow)
            return tinkerless.StepResult(observation=None if done else follow[self.turn - 1], done=done)

    worker = Worker("smollm2")
    request = RolloutRequest(
        policy="base", tasks=[{"first": "What is 2 + 2? Reply with just the number."}], group_size=1,
        sampling=SamplingParams(max_tokens=12, temperature=0.0),
        limits=EpisodeLimits(max_turns=3, max_episode_tokens=2048), seed=0, env=pack_code(Questions),
    )
    (episode,) = worker.rollout(request).episodes
    spans = _sampled_spans(episode)
    end = worker.chat.end_of_turn_id
    assert len(spans) == 3 and spans[0][-1] == end and spans[1][-1] != end, [worker.tokenizer.decode(s) for s in spans]
    expected = _template_tokens(worker.tokenizer, episode.transcript, add_generation_prompt=False)
    tokens = episode.tokens.tolist()
    assert tokens == expected[: len(tokens)]
    assert worker.tokenizer.decode(expected[len(tokens) :]) in ("\n", "<|im_end|>\n")
    assert tokens == _expected_from_template(worker.tokenizer, worker.chat, episode)


# ---- models whose end of turn cannot be determined -----------------------------------------------------------------


def _edit_tiny(tiny_model: str, path: Path, *, tokenizer_changes: dict, template: str | None = "keep") -> str:
    shutil.copytree(tiny_model, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_changes)
    config_path.write_text(json.dumps(config))
    if template is None:
        (path / "chat_template.jinja").unlink(missing_ok=True)
        config.pop("chat_template", None)
        config_path.write_text(json.dumps(config))
    elif template != "keep":
        (path / "chat_template.jinja").write_text(template)
    for name in ("config.json", "generation_config.json"):
        if (path / name).is_file():
            data = json.loads((path / name).read_text())
            if "eos_token_id" in tokenizer_changes:
                data["eos_token_id"] = tokenizer_changes["eos_token_id"]
            (path / name).write_text(json.dumps(data))
    return str(path)


def test_a_model_with_no_end_of_turn_is_refused(tiny_model, tmp_path):
    # A template that writes no special token after a reply, and no EOS anywhere.
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    path = _edit_tiny(tiny_model, tmp_path / "no-eos", tokenizer_changes={"eos_token": None, "eos_token_id": None}, template=plain)
    with pytest.raises(ConfigError, match="cannot determine the model's end-of-turn token") as info:
        Worker(path)
    assert "eos_token" in info.value.hint and info.value.category == "user"


def test_a_model_whose_eos_opens_turns_is_refused(tiny_model, tmp_path):
    """The old SmolLM2 conversion's defect: eos_token '<|im_start|>' while the template ends replies with '<|im_end|>'."""
    im_start = 257
    path = _edit_tiny(tiny_model, tmp_path / "eos-im-start", tokenizer_changes={"eos_token": "<|im_start|>", "eos_token_id": im_start})
    with pytest.raises(ConfigError, match="uses to open turns") as info:
        Worker(path)
    assert "'<|im_end|>'" in info.value.message and "tokenizer_config.json" in info.value.hint


def test_a_base_model_without_template_uses_its_eos(tiny_model, tmp_path):
    path = _edit_tiny(tiny_model, tmp_path / "no-template", tokenizer_changes={}, template=None)
    model, tokenizer = load_model(path)
    assert not tokenizer.chat_template
    chat = ChatFormat(tokenizer, model.generation_config)
    assert chat.end_of_turn_id == tokenizer.eos_token_id and chat.eos_token_ids == [tokenizer.eos_token_id]
    assert tokenizer.decode(chat.observation_tokens("obs", last_token=5)) == "\nuser: obs\nassistant:"
