"""Train the agent you already wrote: an OpenAI-client agent with a calculator tool, learning on SmolLM2 on a CPU.

    python examples/openai_agent.py              # SFT warm start on demonstrations of `solve`'s calls, then RL

or the two phases by hand (`tinkerless train` on this file runs the RL phase, from the base model
unless given --init-from):

    python -c "import examples.openai_agent as a; a.write_demonstrations('demos.jsonl')"
    tinkerless sft demos.jsonl --steps 1 --batch-size 4 --learning-rate 5e-4 --name openai-agent-sft
    tinkerless train examples/openai_agent.py --init-from openai-agent-sft-...@latest

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

The tasks are one-operation calculations ("What is 771 * 57?", `make_calculation_problem`): numbers
too large for a 135M model to guess, so the reward comes from using the tool.

Why a warm start: RL alone does not learn here. The 135M model almost never writes a tool call the
router can parse, so every copy in a group scores alike and group-relative advantages are zero. A
short SFT on a few dozen correct demonstrations makes tool calls likely (not reliable), and RL improves
from there, as in examples/calculator_agent.py. The demonstrations are `solve`'s own calls: `solve`
is played against `ScriptedClient`, which answers with the right tool call and then the right number,
and the conversation is rendered by the router's own step (`template_messages`: the same system
prompt, tool description, tool-call format and chat template the worker's endpoint gives the model),
so SFT teaches the very token sequence RL then samples (tests/test_openai_agent_example.py checks
it token by token through the worker's endpoint). Every demonstration scores 1.0 through `solve`.

Reward (`score`): 1.0 for the right number, else 0.5 when the calculator returned the right number,
0.3 for answering with a (wrong) number the calculator returned, 0.2 for a well-formed calculator call,
0.1 for a botched one, 0 otherwise: partial credit gives a 135M model a signal towards the tool before
it ever answers right (the ladder of examples/calculator_agent.py's env).

Measured here with `python examples/openai_agent.py` (bench/results/agentlearn-2026-11-25.md; 2-core CPU
shared with other jobs, load average 2.2-5.8): SFT 103 s, total 24 min. Reward per RL step (step 0 samples
the SFT-only adapter) 0.044, 0.181, 0.412, 0.575, 0.969, 0.925, 0.956, 0.800; calculator calls per episode
0.00 -> 1.00 from step 4 on; fraction correct 0.00 -> 0.94 at steps 4 and 6 (0.69 at step 7).
RL alone (`tinkerless train examples/openai_agent.py`, same 8 steps) stayed at 0.100 from step 3 on: every
copy wrote a botched `<tool_call>`, every group scored alike, and nothing was left to train on.
"""

import asyncio
import copy
import json
import math
import random
import time
from types import SimpleNamespace

import tinkerless
from tinkerless.cloud.modal_entry import modal_entrypoint
from tinkerless.envs.calculator import (
    CalculatorError, evaluate, format_number, last_number, make_calculation_problem, solved_calculation_problem,
)

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
SYSTEM = "Solve the math problem. Call the calculator to compute, then give the final number in <answer></answer> tags."
# SmolLM2-135M ignores a format given only in the system prompt; a reminder after the question gets it to try the tool.
REMINDER = "Reply with a <tool_call> to the calculator, or with <answer>NUMBER</answer>."
DEMONSTRATIONS = 32  # a few dozen generated, correct episodes of `solve`


def run_calculator(arguments: str) -> tuple[str, float | None]:
    """The tool's reply text and its value (None when the call was not a valid expression)."""
    try:
        value = evaluate(str(json.loads(arguments).get("expression", "")))
    except (CalculatorError, ValueError, TypeError, AttributeError) as exc:
        return f"error: {exc}", None
    return format_number(value), float(value)


def score(task: dict, answer_text: str, results: list, attempted: bool) -> float:
    """The reward ladder. `results`: the calculator's values (None for a call it could not run);
    `attempted`: the model tried a tool call, whether or not it could be parsed and run."""
    answer = last_number(answer_text)
    if answer is not None and math.isclose(answer, task["answer"]):
        return 1.0
    good = [v for v in results if v is not None]
    if any(math.isclose(v, task["answer"]) for v in good):
        return 0.5
    if answer is not None and answer in good:  # used the tool's result, but computed the wrong thing
        return 0.3
    if good:
        return 0.2
    return 0.1 if attempted else 0.0


@tinkerless.agent
async def solve(client, task):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{task['question']}\n\n{REMINDER}"}]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=48)
    reply = first.choices[0].message
    calls = [c for c in reply.tool_calls or [] if c.function.name == "calculator"]
    if not calls:  # answered without the tool (or called some other one): scored as it is
        attempted = bool(reply.tool_calls) or "<tool_call>" in (reply.content or "")
        reward = score(task, reply.content or "", [], attempted)
        return tinkerless.AgentResult(reward=reward, metrics={"tool_calls": 0, "correct": float(reward == 1.0)})
    messages.append(reply.model_dump(exclude_none=True))
    results = []
    for call in calls:
        text, value = run_calculator(call.function.arguments)
        results.append(value)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=24)
    reward = score(task, second.choices[0].message.content or "", results, attempted=True)
    return tinkerless.AgentResult(reward=reward, metrics={"tool_calls": len(calls), "correct": float(reward == 1.0)})


# ---------------------------------------------------------------------------
# demonstrations: `solve` played against scripted replies, rendered as the router renders its calls


class ScriptedClient:
    """Stands in for `openai.AsyncOpenAI` with replies given as model text: each is parsed as the router parses
    what the model wrote (`parse_tool_calls`), so `solve` sees the response the endpoint would give. Records
    every call's arguments in `calls`."""

    def __init__(self, replies: list[str]):
        self.replies, self.calls = list(replies), []
        self.chat = SimpleNamespace(completions=self)

    async def create(self, **request):
        from openai.types.chat import ChatCompletion

        from tinkerless.functions.openai_api.render import parse_tool_calls

        if len(self.calls) >= len(self.replies):
            raise RuntimeError(f"the agent made call {len(self.calls) + 1}; the script has {len(self.replies)} replies")
        self.calls.append(copy.deepcopy(request))
        content, tool_calls = parse_tool_calls(self.replies[len(self.calls) - 1])
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        return ChatCompletion.model_validate({
            "id": f"scripted-{len(self.calls)}", "object": "chat.completion", "created": 0, "model": request["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
        })


def demonstration(rng: random.Random, tokenizer) -> dict:
    """One correct episode of `solve` as SFT chat data `{"messages": [...], "task": ...}`: the messages its last
    call sent plus the answer, as the router gives them to `tokenizer`'s chat template."""
    from tinkerless.functions.openai_api.render import template_messages

    task, expression = solved_calculation_problem(rng)
    call = json.dumps({"name": CALCULATOR["function"]["name"], "arguments": {"expression": expression}})
    answer = f"<answer>{task['answer']}</answer>"
    client = ScriptedClient([f"<tool_call>{call}</tool_call>", answer])
    result = asyncio.run(solve(client, task))
    if result.reward != 1.0:
        raise AssertionError(f"the demonstration for {task} scored {result.reward} through solve, not 1.0")
    last = client.calls[-1]
    messages, template_tools = template_messages(tokenizer, [*last["messages"], {"role": "assistant", "content": answer}],
                                                 last.get("tools"))
    if template_tools is not None:  # SFT data is text turns; a template that renders tools itself needs them passed
        raise NotImplementedError("this model's chat template renders tools itself; the demonstrations are for one that does not (SmolLM2)")
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "task": task}


def make_demonstrations(count: int = DEMONSTRATIONS, *, model: str = "smollm2", seed: int = 0, tokenizer=None) -> list[dict]:
    """`count` demonstrations for `model`'s tokenizer, reproducible from `seed`."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        from tinkerless.functions.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    return [demonstration(random.Random(f"openai-agent-demo:{seed}:{i}"), tokenizer) for i in range(count)]


def write_demonstrations(path: str, count: int = DEMONSTRATIONS, *, model: str = "smollm2", seed: int = 0) -> str:
    """The demonstrations as chat JSONL for `tinkerless sft`."""
    with open(path, "w", encoding="utf-8") as handle:
        for demo in make_demonstrations(count, model=model, seed=seed):
            handle.write(json.dumps({"messages": demo["messages"]}) + "\n")
    return path


# Phase 1: a short SFT warm start on the demonstrations (`main()` fills in its data).
sft_config = tinkerless.SFTConfig(
    name="openai-agent-sft",
    model="smollm2",
    steps=1,  # one step on 4 demonstrations: tool calls become likely, not yet reliable, which leaves RL its part
    batch_size=4,
    learning_rate=5e-4,
    eval_fraction=0.125,  # 4 held-out demonstrations for eval NLL
    eval_every=1,
    checkpoint_every=1,
)

# Phase 2: RL (`tinkerless train` on this file runs this; `main()` runs it from the SFT checkpoint).
config = tinkerless.TrainConfig(
    name="openai-agent",
    model="smollm2",
    agent=solve,
    tasks=make_calculation_problem,
    steps=8,
    batch_size=2,
    group_size=8,  # 8 copies per question, all at once against the worker's endpoint: groups are seldom all-equal
    max_tokens=48,  # caps each completion call (a tool call is about 30 tokens)
    max_turns=2,  # completion calls per copy
    max_episode_tokens=1024,
    temperature=0.8,
    learning_rate=1e-3,
    checkpoint_every=4,
    micro_batch_size=4,  # ~330-token sequences x SmolLM2's 49k vocabulary: small micro-batches keep the update's memory down
)

app = modal_entrypoint(config)  # `modal run examples/openai_agent.py` trains the RL phase on Modal

SHARED = ("model", "seed", "storage", "backend", "engine", "threads", "progress")  # settings both phases take


def main(sft: dict | None = None, **overrides) -> dict:
    """SFT on the demonstrations, then RL from its checkpoint. `overrides` are RL settings (the ones in
    `SHARED` apply to both phases), `sft` SFT settings. Returns and prints the per-step numbers."""
    started = time.perf_counter()
    rl_config = config.replace(**overrides)
    shared = {name: getattr(rl_config, name) for name in SHARED}
    demos = [{"messages": d["messages"]} for d in make_demonstrations(model=rl_config.model, seed=rl_config.seed)]
    warm = tinkerless.sft(sft_config.replace(**shared, data=demos, **(sft or {})))
    sft_s = time.perf_counter() - started
    rl = tinkerless.train(rl_config.replace(init_from=f"{warm.run_id}@latest"))
    summary = {
        "sft_run": warm.run_id, "rl_run": rl.run_id, "sft_s": sft_s, "total_s": time.perf_counter() - started,
        "reward": [m["reward_mean"] for m in rl.metrics],
        "tool_calls": [m.get("agent/tool_calls", math.nan) for m in rl.metrics],
        "correct": [m.get("agent/correct", math.nan) for m in rl.metrics],
    }
    print(f"SFT {summary['sft_s']:.0f}s, total {summary['total_s']:.0f}s")
    for name in ("reward", "tool_calls", "correct"):
        print(f"RL {name} per step (step 0 = the SFT-only policy): " + " ".join(f"{v:.3f}" for v in summary[name]))
    return summary


if __name__ == "__main__":
    main()
