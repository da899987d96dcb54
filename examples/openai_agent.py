"""Train the agent you already wrote: an OpenAI-client agent with a calculator tool, RL-trained on SmolLM2 on a CPU.

    tinkerless train examples/openai_agent.py              # locally: a few minutes per step on a busy 2-core CPU

Trained through a server of your own, the run's adapter is then served by the same server's OpenAI API,
and the same file, unchanged, runs against it:

    export TINKERLESS_API_KEY=$(python -c "import secrets; print(secrets.token_hex(16))")
    tinkerless serve --single-user --api-key-env TINKERLESS_API_KEY --port 8000 &
    tinkerless train examples/openai_agent.py --backend http://127.0.0.1:8000 --run-id calc
    tinkerless eval examples/openai_agent.py --endpoint http://127.0.0.1:8000/v1 --model calc@latest

`solve` is plain OpenAI-client code: one call with `tools=[calculator]`; if the model calls the tool, the
result goes back as a `tool` message and a second call gives the answer. In training, `model="policy"`
is the policy being trained (each copy's client talks to the rollout worker's endpoint, which records
every sampled token); under `tinkerless eval --model NAME` the same calls go to NAME on any
OpenAI-compatible server. See docs/agents.md.

Reward: 1.0 for the right number, else 0.5 when the calculator returned the right number, 0.2 for a
well-formed calculator call, 0.1 for a botched one, 0 otherwise: partial credit gives a 135M model a signal towards the tool
before it ever answers right (the same shaping as examples/calculator_agent.py's env).

Measured here (BENCHMARKS.md): it trains end to end, but in its 4 default steps the 135M model never wrote a
tool call the router could parse, so the reward did not rise. examples/calculator_agent.py shows what does
work at this size: a short SFT warm start on generated tool calls (`init_from=`), then RL.
"""

import json

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.calculator import CalculatorError, evaluate, format_number, last_number, make_word_problem

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, + - * / ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 - 5) * 3"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "Solve the math word problem. Call the calculator to compute, then give the final number in <answer></answer> tags."
# SmolLM2-135M ignores a format given only in the system prompt; a reminder after the question gets it to try the tool.
REMINDER = "Reply with a <tool_call> to the calculator, or with <answer>NUMBER</answer>."


def run_calculator(arguments: str) -> tuple[str, float | None]:
    """The tool's reply text and its value (None when the call was not a valid expression)."""
    try:
        value = evaluate(str(json.loads(arguments).get("expression", "")))
    except (CalculatorError, ValueError, TypeError, AttributeError) as exc:
        return f"error: {exc}", None
    return format_number(value), float(value)


@tinkerless.agent
async def solve(client, task):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{task['question']}\n\n{REMINDER}"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=48)
    reply = first.choices[0].message
    calls = [c for c in reply.tool_calls or [] if c.function.name == "calculator"]
    if not calls:  # answered without the tool: scored as it is (0.1 for a tool call it tried but botched)
        answer = last_number(reply.content or "")
        reward = 1.0 if answer == task["answer"] else 0.1 if "<tool_call>" in (reply.content or "") else 0.0
        return tinkerless.AgentResult(reward=reward, metrics={"tool_calls": 0, "correct": float(reward == 1.0)})
    messages.append(reply.model_dump(exclude_none=True))
    results = []
    for call in calls:
        text, value = run_calculator(call.function.arguments)
        results.append(value)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=24)
    answer = last_number(second.choices[0].message.content or "")
    if answer == task["answer"]:
        reward = 1.0
    elif task["answer"] in results:
        reward = 0.5
    else:
        reward = 0.2 if any(v is not None for v in results) else 0.0
    return tinkerless.AgentResult(reward=reward, metrics={"tool_calls": len(calls), "correct": float(reward == 1.0)})


config = tinkerless.TrainConfig(
    name="openai-agent",
    model="smollm2",
    agent=solve,
    tasks=make_word_problem,
    steps=4,
    batch_size=4,
    group_size=4,  # 16 agent copies per step, all at once against the worker's endpoint
    max_tokens=48,  # caps each completion call (a tool call is about 30 tokens)
    max_turns=2,  # completion calls per copy
    max_episode_tokens=1024,
    temperature=0.8,
    learning_rate=5e-4,
    checkpoint_every=2,
    micro_batch_size=4,  # ~330-token sequences x SmolLM2's 49k vocabulary: small micro-batches keep the update's memory down
)

app = modal_entrypoint(config)  # `modal run examples/openai_agent.py` trains this agent on Modal

if __name__ == "__main__":
    tinkerless.train(config)
