"""Tool-calling RL: SmolLM2-135M solves word problems with a calculator tool, on a CPU.

    tinkerless train examples/calculator_agent.py

The model calls the tool by writing
    <tool_call>{"name": "calculator", "arguments": {"expression": "3 * 12 - 5"}}</tool_call>
gets back <tool_response>31</tool_response> (an observation: mask 0, not trained),
and ends with <answer>31</answer>. A reply without tags is scored as the answer.

Reward (CalculatorEnv): 1.0 for the right number, else 0.5 if a calculator call
returned the right number, 0.2 for a well-formed calculator call, 0.1 for an
attempted one, 0 otherwise; the partial credit gives a 135M model a signal
towards the format before it ever answers right.
"""

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.calculator import CalculatorEnv, make_word_problem

config = tinkerless.TrainConfig(
    name="calculator-agent",
    model="smollm2",
    env=CalculatorEnv,
    tasks=make_word_problem,
    steps=8,
    batch_size=4,
    group_size=4,
    max_turns=3,  # CalculatorEnv allows 2 tool calls, so turn 3 is always its answer
    max_tokens=48,  # a tool call is about 30 tokens
    max_episode_tokens=768,
    temperature=0.8,
    learning_rate=5e-4,
    checkpoint_every=4,
)

app = modal_entrypoint(config)  # `modal run examples/calculator_agent.py` trains this config on Modal

if __name__ == "__main__":
    tinkerless.train(config)
