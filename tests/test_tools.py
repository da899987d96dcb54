"""Tool calling: @tool schemas and coercion, the call/answer text format, ToolEnv steps, the calculator, a real rollout."""

from __future__ import annotations

import json
import random
import time

import pytest

import tinkerless
from tinkerless.envs.calculator import (
    CalculatorEnv,
    CalculatorError,
    calculator,
    make_calculation_problem,
    make_word_problem,
    solved_calculation_problem,
)
from tinkerless.envs.tools import (
    FinalAnswer,
    ParseError,
    Tool,
    ToolCall,
    ToolCallError,
    ToolEnv,
    describe_tools,
    parse_action,
    tool,
)
from tinkerless.errors import UserCodeError, UserError
from tinkerless.wire import pack_code, unpack_code
from tinkerless.wire.messages import EpisodeLimits, RolloutRequest, SamplingParams


@tool
def repeat(word: str, times: int = 2, loud: bool = False) -> str:
    """Repeat a word.

    Args:
        word: the word to repeat
        times: how many times
    """
    text = " ".join([word] * times)
    return text.upper() if loud else text


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@tinkerless.env
class EchoEnv(ToolEnv):
    tools = [repeat, explode]
    max_tool_calls = 2
    format_penalty = 0.1

    def reset(self, target: str) -> str:
        self.target = target
        return f"say {target}"

    def score(self, answer: str) -> float:
        return 1.0 if answer == self.target else 0.25


# --- @tool ---------------------------------------------------------------------------


def test_tool_schema_comes_from_annotations_defaults_and_docstring():
    assert isinstance(repeat, Tool) and repeat.name == "repeat" and repeat.description == "Repeat a word."
    assert repeat.parameters == {
        "type": "object",
        "properties": {
            "word": {"type": "string", "description": "the word to repeat"},
            "times": {"type": "integer", "description": "how many times", "default": 2},
            "loud": {"type": "boolean", "default": False},
        },
        "required": ["word"],
    }
    assert repeat(word="ha") == "ha ha"  # still callable like the function


def test_tool_schema_maps_every_supported_type():
    @tool(name="all_types", description="Takes everything.")
    def f(a: float, b: list[int], c: dict, d: int | None = None) -> None: ...

    props = f.parameters["properties"]
    assert f.name == "all_types" and f.description == "Takes everything."
    assert [props[k]["type"] for k in "abcd"] == ["number", "array", "object", ["integer", "null"]]
    assert f.parameters["required"] == ["a", "b", "c"]


def test_arguments_are_coerced_to_their_declared_types():
    assert repeat(word="ho", times="3") == "ho ho ho"
    assert repeat(word="ho", times=2.0, loud="true") == "HO HO"
    assert repeat(word=7, times=1) == "7"  # a number where a string was declared reads as its text


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({"word": "a", "times": "three"}, "argument 'times': expected integer, got 'three'"),
        ({"word": "a", "times": 2.5}, "argument 'times'"),
        ({"word": "a", "times": True}, "argument 'times'"),
        ({"word": "a", "loud": "maybe"}, "argument 'loud': expected boolean"),
        ({"word": ["a"]}, "argument 'word': expected string"),
        ({"times": 2}, "missing required argument 'word'"),
        ({"word": "a", "volume": 3}, "has no argument 'volume'"),
    ],
)
def test_bad_arguments_raise_tool_call_error_naming_tool_and_argument(arguments, fragment):
    with pytest.raises(ToolCallError) as info:
        repeat(**arguments)
    assert isinstance(info.value, UserError)
    assert "tool 'repeat'" in info.value.message and fragment in info.value.message
    assert info.value.hint


def test_functions_without_annotations_docstrings_or_with_varargs_are_rejected_at_decoration():
    def unannotated(x):
        """Doc."""

    def varargs(*numbers: int):
        """Doc."""

    def undocumented(x: int):
        pass

    def odd_type(x: set):
        """Doc."""

    for fn, fragment in [(unannotated, "no type annotation"), (varargs, "*numbers"), (undocumented, "no docstring"), (odd_type, "unsupported type")]:
        with pytest.raises(UserCodeError) as info:
            tool(fn)
        assert fragment in info.value.message and info.value.hint


def test_toolenv_subclass_with_a_plain_function_in_tools_is_rejected():
    def plain(x: int) -> int:
        """Doc."""
        return x

    with pytest.raises(UserCodeError, match="not a Tool"):
        type("BadEnv", (ToolEnv,), {"tools": [plain]})


# --- parse_action --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "3 * 7"}}</tool_call>', ToolCall("calculator", {"expression": "3 * 7"})),
        ('Let me compute.\n<tool_call>\n  {"name":"calculator","arguments":{"expression":"1+1"}}  \n</tool_call>', ToolCall("calculator", {"expression": "1+1"})),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "2*2"}}', ToolCall("calculator", {"expression": "2*2"})),  # cut off
        ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"5\\"}"}</tool_call>', ToolCall("calculator", {"expression": "5"})),
        ('<tool_call>{"name": "noargs"}</tool_call>', ToolCall("noargs", {})),
        ("<answer> 21 </answer>", FinalAnswer("21")),
        ("I think <ANSWER>31</ANSWER> is right", FinalAnswer("31")),
        ("<answer>12", FinalAnswer("12")),
        ("Working...\n  Final answer: 42 apples\nThanks", FinalAnswer("42 apples")),
        ('<answer>7</answer> <tool_call>{"name": "x"}</tool_call>', FinalAnswer("7")),  # the first action wins
        ("The answer is 42.", None),
        ("", None),
    ],
)
def test_parse_action_reads_calls_answers_and_fallbacks(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("<tool_call>{'name': 'calculator', 'arguments': {}}</tool_call>", "invalid JSON"),
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+</tool_call>', "invalid JSON"),
        ("<tool_call>calculator(3*7)</tool_call>", "no JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', '"arguments" must be a JSON object'),
    ],
)
def test_malformed_tool_calls_are_parse_error_results_not_exceptions(text, fragment):
    result = parse_action(text)
    assert isinstance(result, ParseError) and fragment in result.message


def test_describe_tools_lists_schema_format_and_a_real_worked_example():
    text = describe_tools([calculator, repeat])
    assert "- calculator: Evaluate an arithmetic expression" in text
    assert json.dumps(calculator.parameters) in text and json.dumps(repeat.parameters) in text
    assert '<tool_call>{"name": "TOOL_NAME", "arguments": {...}}</tool_call>' in text and "<answer>" in text
    example = text.split("Example:\n", 1)[1].splitlines()
    assert example == [_call("calculator", expression="3 * 7"), "<tool_response>21</tool_response>", "<answer>21</answer>"]
    # The worked example parses as the call it shows.
    assert parse_action(example[0]) == ToolCall("calculator", {"expression": "3 * 7"})


# --- the calculator --------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, value",
    [("3 * 7", "21"), ("(12 - 5) * 3", "21"), ("7 / 2", "3.5"), ("42 / 2", "21"), ("-2 ** 2", "-4"), ("2 ** -1", "0.5"), (" 36 - 5 = ", "31"), ("1.5 + 1.5", "3")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression=expression) == value


@pytest.mark.parametrize(
    "expression, fragment",
    [
        ("__import__('os')", "function call"),
        ("().__class__", "attribute access"),
        ("x + 1", "name 'x'"),
        ("1 / 0", "division by zero"),
        ("3 *", "cannot parse"),
        ("9**9**9", "too large"),
        ("10**99 * 10**99", "too large"),
        ("2 ** 0.5 ** -2000", "too large"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "not allowed"),
        ("(" * 150 + "1" + ")" * 150, "expression"),
    ],
)
def test_calculator_rejects_unsafe_or_bad_expressions_quickly(expression, fragment):
    started = time.perf_counter()
    with pytest.raises(CalculatorError) as info:
        calculator(expression=expression)
    assert fragment in str(info.value)
    assert time.perf_counter() - started < 1.0  # an error, never a hang


def test_calculation_problems_state_one_operation_with_an_integer_answer_too_large_to_guess():
    tasks = [make_calculation_problem(random.Random(seed)) for seed in range(200)]
    assert tasks == [make_calculation_problem(random.Random(seed)) for seed in range(200)]
    assert len({t["question"] for t in tasks}) == 200
    symbols = set()
    for seed in range(200):
        task, expression = solved_calculation_problem(random.Random(seed))
        assert calculator(expression=expression) == str(task["answer"])  # integer: divisions are exact
        assert isinstance(task["answer"], int) and abs(task["answer"]) >= 10
        left, symbol, right = expression.split()
        symbols.add(symbol)
        assert left in task["question"] and right in task["question"]  # the operands are stated
    assert symbols == {"+", "-", "*", "/"}
    assert any("times" in t["question"] or "divided by" in t["question"] for t in tasks)  # some in words


def test_word_problems_are_deterministic_and_have_positive_integer_answers():
    tasks = [make_word_problem(random.Random(seed)) for seed in range(60)]
    assert tasks == [make_word_problem(random.Random(seed)) for seed in range(60)]
    assert len({t["question"].split()[1] for t in tasks}) >= 4  # several templates appear
    for task in tasks:
        assert set(task) == {"question", "answer"}
        assert isinstance(task["answer"], int) and task["answer"] > 0 and "?" in task["question"]


# --- ToolEnv.step ----------------------------------------------------------------------


def _env(cls=EchoEnv, **task):
    instance = cls()
    instance.reset(**(task or {"target": "ha ha"}))
    return instance


def test_system_prompt_is_instructions_plus_tool_descriptions():
    prompt = _env().system_prompt()
    assert prompt.startswith(ToolEnv.instructions) and describe_tools(EchoEnv.tools) in prompt


def test_tool_call_returns_the_result_as_an_observation_and_goes_on():
    env = _env()
    result = env.step("sure " + _call("repeat", word="ha", times="3"))
    assert result.observation == "<tool_response>ha ha ha</tool_response>"
    assert result.reward == 0 and not result.done and result.info == {"tool_calls": 1, "tool_errors": 0}


def test_a_tool_that_raises_becomes_an_error_observation_without_penalty():
    env = _env()
    result = env.step(_call("explode", reason="test"))
    assert result.observation == "<tool_response>error: boom: test</tool_response>"
    assert result.reward == 0 and not result.done and result.info["tool_errors"] == 1
    final = env.step("<answer>ha ha</answer>")  # the episode continues normally
    assert final.done and final.reward == 1.0


def test_unknown_tool_bad_arguments_and_parse_errors_cost_the_format_penalty():
    for action, fragment in [
        (_call("fly", height=3), "unknown tool 'fly'; available tools: repeat, explode"),
        (_call("repeat", word="a", times="lots"), "argument 'times'"),
        ("<tool_call>{name: repeat}</tool_call>", "invalid JSON"),
    ]:
        result = _env().step(action)
        assert result.observation.startswith("<tool_response>error: ") and fragment in result.observation
        assert result.reward == pytest.approx(-0.1) and not result.done


def test_final_answer_ends_with_the_score_and_counts_calls():
    env = _env()
    env.step(_call("repeat", word="ha"))
    result = env.step("Final answer: ha ha")
    assert result.observation is None and result.done and result.reward == 1.0
    assert result.info == {"tool_calls": 1, "tool_errors": 0, "answered": 1}


def test_text_with_no_call_and_no_answer_is_scored_as_the_answer():
    assert _env().step("  ha ha \n").reward == 1.0
    assert _env().step("something else").reward == 0.25


def test_calls_past_max_tool_calls_end_the_episode_with_zero_reward():
    env = _env()
    for _ in range(EchoEnv.max_tool_calls):
        assert not env.step(_call("repeat", word="x")).done
    result = env.step(_call("repeat", word="x"))
    assert result.done and result.observation is None and result.reward == 0.0
    assert result.info == {"tool_calls": 2, "tool_errors": 0, "answered": 0, "out_of_tool_calls": 1}


def test_long_tool_output_is_truncated():
    class Long(EchoEnv):
        max_response_chars = 20

    result = _env(Long).step(_call("repeat", word="abcdefghij", times=10))
    assert result.observation == "<tool_response>abcdefghij abcdefghi...(truncated)</tool_response>"


# --- CalculatorEnv ---------------------------------------------------------------------

_TASK = {"question": "Tom has 3 boxes of 12 apples and eats 5. How many apples are left?", "answer": 31}


def test_calculator_env_rewards_right_answers_and_gives_partial_credit():
    def play(*turns: str) -> float:
        env = _env(CalculatorEnv, **_TASK)
        return sum(env.step(turn).reward for turn in turns)

    assert play("<answer>31</answer>") == 1.0
    assert play("Tom has 36 apples, eats 5, so 31 are left.") == 1.0  # untagged text is the answer
    assert play("<answer>30</answer>") == 0.0
    assert play(_call("calculator", expression="3 * 12"), "<answer>36</answer>") == 0.3  # answered with the tool's (wrong) result
    assert play(_call("calculator", expression="3 * 12"), "<answer>35</answer>") == 0.2  # well-formed call, answer not from it
    assert play(_call("calculator", expression="3 * 12"), "<answer>I am not sure</answer>") == 0.2
    assert play(_call("calculator", expression="3 * 12"), _call("calculator", expression="3 + 12"), "<answer>36</answer>") == 0.3
    assert play(_call("calculator", expression="3 * 12 - 5"), "<answer>I am not sure</answer>") == 0.5
    assert play(_call("calculator", expression="3 * 12 - 5"), "<answer>31</answer>") == 1.0
    assert play(_call("calculator", expression="3 * 12 - 5"), "<answer>36</answer>") == 0.5  # right result beats a wrong answer
    assert play(_call("calculator", expression="3 apples"), "<answer>36</answer>") == 0.1  # tried; the call failed
    assert play("<tool_call>{'expression': '3*12'}</tool_call>", "<answer>36</answer>") == 0.1  # tried; bad JSON
    calls = [_call("calculator", expression="3 * 12")] * (CalculatorEnv.max_tool_calls + 1)
    assert play(*calls) == 0.2  # ran out of calls: still partial credit for using the tool


def test_calculator_env_question_ends_with_the_format_reminder():
    first = CalculatorEnv().reset(**_TASK)
    assert first.startswith(_TASK["question"]) and first.endswith("<answer>NUMBER</answer>.")


def test_calculator_env_error_observation_for_bad_expression():
    result = _env(CalculatorEnv, **_TASK).step(_call("calculator", expression="36 / 0"))
    assert result.observation == "<tool_response>error: division by zero</tool_response>" and not result.done


# --- shipping and running -------------------------------------------------------------


def test_toolenv_subclass_survives_the_cloudpickle_round_trip():
    rebuilt = unpack_code(pack_code(EchoEnv))
    env = rebuilt()
    env.reset(target="go go")
    assert env.step(_call("repeat", word="go")).observation == "<tool_response>go go</tool_response>"
    assert env.step("<answer>go go</answer>").reward == 1.0
    assert unpack_code(pack_code(calculator))(expression="6 * 7") == "42"


@tinkerless.env
class ForcedCallEnv(ToolEnv):
    """Turns every model turn into a real tool call, so the tiny random model exercises tool responses."""

    tools = [repeat]
    max_tool_calls = 2

    def reset(self, word: str) -> str:
        return f"repeat {word}"

    def step(self, action: str) -> tinkerless.StepResult:
        return super().step(_call("repeat", word=action[:5] or "x", times=1))

    def score(self, answer: str) -> float:
        return 1.0


def test_real_rollout_on_tiny_model_masks_tool_responses(worker):
    sampling, limits = SamplingParams(max_tokens=8), EpisodeLimits(max_turns=3, max_episode_tokens=2048)
    calc = worker.rollout(
        RolloutRequest(policy="base", tasks=[_TASK], group_size=2, sampling=sampling, limits=limits, seed=0, env=pack_code(CalculatorEnv))
    ).episodes
    for episode in calc:
        assert episode.status in ("ok", "truncated"), episode.error
        assert episode.transcript[0]["role"] == "system" and "<tool_call>" in episode.transcript[0]["content"]
        assert episode.reward in (0.0, 0.1, 0.2, 0.3, 0.5, 1.0)

    forced = worker.rollout(
        RolloutRequest(policy="base", tasks=[{"word": "hi"}], group_size=2, sampling=sampling, limits=limits, seed=0, env=pack_code(ForcedCallEnv))
    ).episodes
    decode = worker.chat.tokenizer.decode
    for episode in forced:
        # Two tool calls answered, the third call ends the episode (out of tool calls).
        assert episode.status == "ok" and episode.num_turns == 3 and episode.info["out_of_tool_calls"] == 1
        responses = [m["content"] for m in episode.transcript if m["role"] == "user"][1:]
        assert len(responses) == 2 and all(r.startswith("<tool_response>") for r in responses)
        trained = decode(episode.tokens[episode.mask == 1].tolist())
        unseen = decode(episode.tokens[episode.prompt_length :][episode.mask[episode.prompt_length :] == 0].tolist())
        assert "<tool_response>" not in trained and unseen.count("<tool_response>") == 2
        mask = episode.mask[episode.prompt_length :].astype(int).tolist()
        runs = [mask[0]] + [b for a, b in zip(mask, mask[1:]) if a != b]
        assert runs == [1, 0, 1, 0, 1]  # sampled turn, tool response, sampled, tool response, sampled
