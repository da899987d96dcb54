"""A `python` tool that runs model-written code in the sandbox, small integer puzzles, and `PythonToolEnv`.

The model writes a program; the tool runs it in the sandbox (bubblewrap by default,
see docs/sandbox.md) under `TOOL_LIMITS` and answers with a `ToolObservation`:
what the program printed, and when it did not finish cleanly, its exit status,
the limit it hit and the end of its stderr. A program that fails, hangs, forks or
touches the network is an observation the model reads; the episode goes on.
Where the sandbox cannot run, the tool raises `SandboxUnavailable` (the run stops
and says how to fix it) rather than running the code less isolated.
"""

from __future__ import annotations

import math
import random
import re
import signal
from typing import Callable, ClassVar

from tinkerless.envs.sandbox import SandboxLimits, SandboxResult, run_python, sandbox_kind
from tinkerless.envs.tools import Tool, ToolEnv, ToolObservation, tool
from tinkerless.envs.decorators import env

# Read at call time, so tests and deployments can tighten it.
TOOL_LIMITS = SandboxLimits(cpu_seconds=2.0, wall_seconds=5.0, memory_bytes=256 * 2**20, max_output_bytes=4096)
ERROR_TAIL_CHARS = 600  # the end of a traceback says what went wrong; keep the observation short
STDOUT_TAIL_CHARS = 400  # of a failed run's stdout: enough to show how far it got

_LIMIT_MESSAGES: dict[str, Callable[[SandboxLimits], str]] = {
    "timeout": lambda l: f"it ran longer than {l.wall_seconds:g} s (wall-clock limit) and was stopped",
    "cpu_limit": lambda l: f"it used more than {l.cpu_limit} s of CPU time (CPU limit) and was stopped",
    "memory_limit": lambda l: f"it ran out of memory (memory limit {l.memory_bytes // 2**20} MiB)",
    "file_limit": lambda l: f"it wrote a file larger than {l.max_file_bytes} bytes (file-size limit)",
    "disk_limit": lambda l: f"it filled its work directory ({l.disk_bytes // 2**20} MiB disk limit)",
    "process_limit": lambda l: f"it started more processes or threads than allowed ({l.max_processes})",
    "open_files_limit": lambda l: "it opened too many files at once (open-file limit)",
}


def exit_status(result: SandboxResult) -> str:
    code = result.exit_code
    if code is None:
        return "exit status unknown"
    if code < 0 or (result.sandbox == "bwrap" and 128 < code < 128 + 65 and result.reason not in ("ok", "error")):
        number = -code if code < 0 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return f"killed by signal {name}"
    return f"exit status {code}"


def describe_failure(result: SandboxResult, limits: SandboxLimits) -> str:
    """One line saying why a sandboxed run did not finish cleanly: the limit it hit, or its exit status."""
    status = exit_status(result)
    if result.reason in _LIMIT_MESSAGES:
        return f"the program was stopped: {_LIMIT_MESSAGES[result.reason](limits)} ({result.reason}, {status})"
    if result.reason == "forbidden":
        return f"the program tried something the sandbox does not allow ({status})"
    if result.reason == "error":
        return f"the program failed ({status})"
    return f"the program was killed ({result.reason}, {status})"


def format_observation(result: SandboxResult, limits: SandboxLimits) -> ToolObservation:
    """The tool's answer: stdout; and for a run that did not end cleanly, also why, its exit status and stderr."""
    stdout, stderr = result.stdout.rstrip(), result.stderr.strip()
    if result.ok:
        text = stdout
        if stderr:  # warnings and the like: useful, but after the output
            text += f"\n[stderr]\n{stderr[-ERROR_TAIL_CHARS:]}"
        if result.truncated:
            text += f"\n[output limit: only the first {limits.max_output_bytes} bytes are shown]"
        return ToolObservation(text if text.strip() else "(the program printed nothing; use print() to show the result)")
    parts = [f"error: {describe_failure(result, limits)}"]
    if stdout:
        parts.append(f"[stdout]\n{stdout[-STDOUT_TAIL_CHARS:]}")
    if stderr:
        parts.append(f"[stderr]\n{stderr[-ERROR_TAIL_CHARS:]}")
    return ToolObservation("\n".join(parts), ok=False)


def python_tool(*, sandbox: str | None = None, limits: SandboxLimits | None = None) -> Tool:
    """A `python` tool running in the named sandbox ("bwrap", "modal" or, by explicit opt-in only, "process-unsafe").

    `limits=None` reads `TOOL_LIMITS` at call time. The name is checked now, so a
    typo fails when the env class is defined rather than at the first tool call.
    """
    if sandbox is not None:
        sandbox_kind(sandbox)

    @tool(example={"code": "print(6 * 7)"})
    def python(code: str) -> ToolObservation:
        """Run a Python 3 program and return what it prints; print the result. Standard library only, no network.

        Args:
            code: the complete program, e.g. print(sum(i * i for i in range(1, 11)))
        """
        chosen = limits if limits is not None else TOOL_LIMITS
        return format_observation(run_python(code, limits=chosen, sandbox=sandbox), chosen)

    return python


python = python_tool()


# ---------------------------------------------------------------------------
# tasks: short questions with integer answers that are easy to compute and hard to guess


def _sum_of_squares(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(10, 400)
    return f"What is the sum of the squares of the integers from 1 to {n}?", n * (n + 1) * (2 * n + 1) // 6


def _primes_below(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(50, 20_000)
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
    return f"How many prime numbers are there below {n}?", sum(sieve)


def _digit_sum_of_power(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(20, 600)
    return f"What is the sum of the decimal digits of 2 to the power {n}?", sum(map(int, str(2**n)))


def _divisor_count(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(100, 200_000)
    count = sum(2 - (d * d == n) for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return f"How many positive divisors does {n} have?", count


def _divisible_by_either(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(100, 50_000)
    a, b = rng.sample(range(2, 14), 2)
    answer = n // a + n // b - n // math.lcm(a, b)
    return f"How many integers from 1 to {n} are divisible by {a} or by {b}?", answer


def _fibonacci_mod(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(20, 2000)
    x, y = 0, 1
    for _ in range(n):
        x, y = y, x + y
    return f"With F(1) = F(2) = 1 and F(k) = F(k-1) + F(k-2), what is F({n}) modulo 1000?", x % 1000


def _collatz_steps(rng: random.Random) -> tuple[str, int]:
    start = rng.randint(2, 5000)
    n, steps = start, 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return (
        f"Starting from {start}, repeatedly halve the number if it is even, or triple it and add 1 if it is odd. "
        "How many steps does it take to reach 1?",
        steps,
    )


TASKS: list[Callable[[random.Random], tuple[str, int]]] = [
    _sum_of_squares,
    _primes_below,
    _digit_sum_of_power,
    _divisor_count,
    _divisible_by_either,
    _fibonacci_mod,
    _collatz_steps,
]


def make_python_task(rng: random.Random) -> dict:
    """A task `{"question": str, "answer": int}` from a random template with random numbers."""
    question, answer = rng.choice(TASKS)(rng)
    return {"question": question, "answer": answer}


# ---------------------------------------------------------------------------
# the env

_INTEGER = re.compile(r"-?\d+(?:,\d{3})*")


def last_integer(text: str) -> int | None:
    """The last integer in a text ("... so there are 1,229 primes." -> 1229)."""
    found = _INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


_PROMPTS: dict[tuple[type, str], str] = {}


@env
class PythonToolEnv(ToolEnv):
    """Integer puzzles solved by writing Python. Reward, with partial credit so a small model has signal:

    - 1.0: the last integer in the final answer is the right one;
    - 0.5: not answered right, but a program that ran printed the right number last;
    - 0.2: not answered right, but a well-formed python call ran to completion;
    - 0.0: otherwise (including programs that crashed, hung or were stopped).
    """

    tools = [python]
    max_tool_calls = 3
    instructions: ClassVar[str] = (
        "Solve the problem by writing a short Python program. Call the python tool to run it "
        "(print the result), then give the final integer in <answer></answer> tags."
    )

    def reset(self, question: str, answer: int) -> str:
        self.question = question
        self.answer = int(answer)
        return question

    def system_prompt(self) -> str:
        # The tool's worked example runs in the sandbox (~50 ms); do that once per class, not per episode.
        key = (type(self), self.instructions)
        if key not in _PROMPTS:
            _PROMPTS[key] = super().system_prompt()
        return _PROMPTS[key]

    def score(self, answer: str) -> float:
        if last_integer(answer) == self.answer:
            return 1.0
        return self.partial_credit()

    def out_of_tool_calls(self) -> float:
        return self.partial_credit()

    def partial_credit(self) -> float:
        ran = [c for c in self.calls if c.ok and c.name == python.name]
        if any(last_integer(c.result) == self.answer for c in ran):
            return 0.5
        return 0.2 if ran else 0.0


__all__ = [
    "PythonToolEnv",
    "TASKS",
    "TOOL_LIMITS",
    "describe_failure",
    "format_observation",
    "last_integer",
    "make_python_task",
    "python",
    "python_tool",
]
