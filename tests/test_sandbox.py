"""The Python sandbox stops what it must (and says why), runs what it should, and PythonToolEnv survives it.

Every run is a real subprocess; limits are kept small so the whole file stays fast.
"""

from __future__ import annotations

import json
import os
import random
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tinkerless.envs import python_tool
from tinkerless.envs.python_tool import PythonToolEnv, last_integer, make_python_task, python
from tinkerless.envs.sandbox import SandboxLimits, run_python
from tinkerless.errors import ConfigError
from tinkerless.wire import pack_code, unpack_code

pytestmark = pytest.mark.timeout(60)

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3)


def live_processes_in_session(sid: int) -> list[str]:
    """Processes (not zombies) whose session is `sid`: what a sandbox left running."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat[stat.rfind(")") + 2 :].split()
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found.append(f"{entry} {stat[:80]}")
    return found


def all_rlimits() -> dict[str, tuple[int, int]]:
    return {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}


# ---------------------------------------------------------------------------
# normal code


def test_normal_code_prints_and_uses_its_own_directory():
    result = run_python(
        "import os\n"
        "with open('notes.txt', 'w') as f:\n"
        "    f.write('kept')\n"
        "os.mkdir('sub')\n"
        "with open('sub/data.txt', 'w') as f:\n"
        "    f.write('inner')\n"
        "print(open('notes.txt').read(), open('sub/data.txt').read(), sorted(os.listdir('.')))\n"
        "print(os.getcwd())\n"
    )
    assert result.ok and result.reason == "ok" and result.exit_code == 0, result
    first, cwd = result.stdout.splitlines()
    assert first == "kept inner ['notes.txt', 'sub']"
    assert not os.path.exists(cwd), "the working directory is removed after the run"
    assert result.seconds < 3


def test_each_run_gets_a_fresh_directory():
    first = run_python("open('left.txt', 'w').write('x'); import os; print(os.getcwd())")
    second = run_python("import os; print(os.listdir('.'), os.getcwd())")
    assert second.ok and second.stdout.startswith("[]")
    assert first.stdout.strip() not in second.stdout


def test_exception_reports_error_with_the_traceback():
    result = run_python("def f():\n    return 1 / 0\nprint('before')\nf()\n")
    assert not result.ok and result.reason == "error" and result.exit_code == 1
    assert result.stdout == "before\n"
    assert "Traceback" in result.stderr and "ZeroDivisionError" in result.stderr
    assert 'File "main.py", line 2, in f' in result.stderr and "return 1 / 0" in result.stderr
    assert "<string>" not in result.stderr, "the bootstrap's frames are hidden"


def test_syntax_error_and_exit_codes():
    assert run_python("def (").reason == "error"
    exited = run_python("import sys; print('bye'); sys.exit(3)")
    assert exited.reason == "error" and exited.exit_code == 3 and exited.stdout == "bye\n"


def test_stdin_is_passed():
    result = run_python("print(input()[::-1]); print(input())", stdin="hello\nworld\n")
    assert result.ok and result.stdout == "olleh\nworld\n"


def test_standard_library_works():
    result = run_python(
        "import json, re, math, fractions, itertools, collections, dataclasses, pickle, tempfile, asyncio\n"
        "@dataclasses.dataclass\nclass A:\n    x: int\n"
        "assert pickle.loads(pickle.dumps(A(1))) == A(1)\n"
        "fd, path = tempfile.mkstemp(); os = __import__('os'); os.write(fd, b'x'); os.close(fd)\n"
        "asyncio.run(asyncio.sleep(0))\n"
        "print(math.comb(10, 3), json.dumps({'a': 1}))\n"
    )
    assert result.ok, result.stderr
    assert result.stdout == '120 {"a": 1}\n'


def test_output_is_truncated():
    limits = SandboxLimits(max_output_bytes=1000)
    result = run_python("print('x' * 100_000)\nimport sys; sys.stderr.write('e' * 50_000)", limits=limits)
    assert result.ok and result.truncated
    assert result.stdout.startswith("x" * 1000) and "output truncated" in result.stdout
    assert len(result.stdout) < 1100 and len(result.stderr) < 1100


def test_endless_output_is_bounded():
    result = run_python("while True:\n    print('y' * 1000)", limits=SandboxLimits(cpu_seconds=1, wall_seconds=3, max_output_bytes=2000))
    assert result.reason in ("cpu_limit", "timeout") and result.truncated
    assert len(result.stdout) < 2200


# ---------------------------------------------------------------------------
# the cases from the issue: each stopped, with a clear reason, quickly


def test_infinite_loop_is_stopped():
    started = time.monotonic()
    result = run_python("while True:\n    pass\n", limits=FAST)
    assert not result.ok and result.reason in ("cpu_limit", "timeout"), result
    assert time.monotonic() - started < FAST.wall_seconds + 2


def test_ignoring_sigxcpu_still_hits_the_hard_cpu_limit():
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"
    result = run_python(code, limits=SandboxLimits(cpu_seconds=1, wall_seconds=4))
    assert result.reason in ("cpu_limit", "timeout"), result


def test_sleep_hits_the_wall_clock():
    started = time.monotonic()
    result = run_python("import time\nprint('start', flush=True)\ntime.sleep(100)\n", limits=SandboxLimits(wall_seconds=1))
    assert result.reason == "timeout" and not result.ok
    assert result.exit_code == -9 and result.stdout == "start\n"
    assert time.monotonic() - started < 3
    assert live_processes_in_session(result.pid) == []


def test_fork_bomb_is_forbidden_and_leaves_no_process():
    result = run_python("import os\nwhile True:\n    os.fork()\n", limits=FAST)
    assert result.reason == "forbidden", result
    assert "SandboxViolation: sandbox: os.fork is not allowed" in result.stderr
    assert result.seconds < 2
    assert live_processes_in_session(result.pid) == []


def test_fork_bomb_that_swallows_the_error_is_still_stopped():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n"
    result = run_python(code, limits=FAST)
    assert result.reason == "forbidden" and "stopped after 16 forbidden operations" in result.stderr
    assert result.seconds < 2


def test_allowed_children_are_killed_with_the_group():
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(100)\nprint('parent done')\n"
    result = run_python(code, limits=SandboxLimits(max_processes=1, wall_seconds=3))
    assert result.ok and result.stdout == "parent done\n"
    assert result.seconds < 2.5, "a sleeping child must not hold the run open"
    time.sleep(0.1)
    assert live_processes_in_session(result.pid) == []
    too_many = run_python("import os\nos.fork()\nos.fork()\n", limits=SandboxLimits(max_processes=1))
    assert too_many.reason == "forbidden" and "limit of 1 extra" in too_many.stderr


def test_threads_are_forbidden_by_default():
    result = run_python("import threading\nthreading.Thread(target=print).start()\n")
    assert result.reason == "forbidden" and "threads are not allowed" in result.stderr


def test_huge_allocation_is_a_memory_limit():
    result = run_python("x = bytearray(10 * 2**30)\n", limits=FAST)
    assert result.reason == "memory_limit" and "MemoryError" in result.stderr
    slow = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n", limits=FAST)
    assert slow.reason == "memory_limit", slow


def test_network_access_is_forbidden_and_nothing_connects():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        direct = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", limits=FAST)
        raw = run_python(
            "import _socket\n"
            "for attempt in range(3):\n"
            "    try:\n"
            f"        _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM).connect(('127.0.0.1', {port}))\n"
            "    except PermissionError as exc:\n"
            "        print('denied:', exc)\n",
            limits=FAST,
        )
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody ever connected
    assert direct.reason == "forbidden" and "network access is not allowed" in direct.stderr
    assert raw.ok and raw.stdout.count("denied: sandbox: network access is not allowed") == 3
    lookup = run_python("import socket\nsocket.getaddrinfo('example.com', 80)\n")
    assert lookup.reason == "forbidden"


@pytest.mark.parametrize(
    "code",
    [
        "open({target!r}, 'w').write('escaped')",
        "open('../' * 40 + {target!r}.lstrip('/'), 'w').write('escaped')",
        "import os\nos.makedirs('a/b')\nos.chdir('a/b')\nopen('../../../' * 20 + {target!r}.lstrip('/'), 'a')",
        "import os\nos.symlink({target!r}, 'link')\nopen('link', 'w').write('escaped')",
        "import os\nos.symlink('../../' * 20 + {target!r}.lstrip('/'), 'link')",
        "import os\nfd = os.open({target_dir!r}, os.O_RDONLY)\nos.open('escape.txt', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
        "import os\nos.open({target!r}, os.O_WRONLY | os.O_CREAT)",
        "import os\nopen('inside.txt', 'w').write('escaped')\nos.rename('inside.txt', {target!r})",
        "import os\nopen('inside.txt', 'w').write('escaped')\nos.link('inside.txt', {target!r})",
        "import os\nos.mkdir({target!r})",
        "import pathlib\npathlib.Path({target!r}).write_text('escaped')",
        "import shutil\nopen('inside.txt', 'w').write('escaped')\nshutil.copy('inside.txt', {target!r})",
        "import os\nos.mkfifo({target!r})",
        "open('/proc/self/cwd/../' + 'escape.txt', 'w')",
    ],
)
def test_writing_outside_the_directory_is_forbidden(tmp_path, code):
    target = tmp_path / "escape.txt"
    result = run_python(code.format(target=str(target), target_dir=str(tmp_path)), limits=FAST)
    assert result.reason == "forbidden", result
    assert "sandbox:" in result.stderr
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_other_files_cannot_be_changed_or_read(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original")
    victim.chmod(0o644)
    for code in (
        f"import os\nos.remove({str(victim)!r})",
        f"import os\nos.chmod({str(victim)!r}, 0o777)",
        f"import os\nos.truncate({str(victim)!r}, 0)",
        f"import os\nos.utime({str(victim)!r}, (0, 0))",
        f"print(open({str(victim)!r}).read())",
        "print(open('/etc/passwd').read())",
        "import os\nprint(open('/proc/%d/environ' % os.getppid()).read())",
    ):
        result = run_python(code, limits=FAST)
        assert result.reason == "forbidden", (code, result)
        assert "original" not in result.stdout and "root:" not in result.stdout
    assert victim.read_text() == "original" and victim.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    "code, message",
    [
        ("import subprocess\nsubprocess.run(['true'])", "running other programs"),
        ("import os\nos.system('true')", "running other programs"),
        ("import os\nos.execv('/bin/true', ['true'])", "running other programs"),
        ("import os\nos.posix_spawn('/bin/true', ['true'], {})", "running other programs"),
        ("import ctypes", "importing ctypes"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "changing resource limits"),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)", "signalling other processes"),
        ("import os\nos.setsid()", "os.setsid"),
        ("import gc\ngc.get_objects()", "gc.get_objects"),
        ("import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess", "importing _posixsubprocess"),
    ],
)
def test_escape_routes_are_forbidden(code, message):
    result = run_python(code, limits=FAST)
    assert result.reason == "forbidden", result
    assert message in result.stderr


def test_file_size_limit():
    result = run_python("open('big.bin', 'wb').write(b'x' * 2**20 * 2)\n", limits=SandboxLimits(max_file_bytes=2**20))
    assert result.reason == "file_limit", result


def test_parent_process_is_unaffected():
    before_limits, before_cwd, before_env = all_rlimits(), os.getcwd(), dict(os.environ)
    run_python("import os\nos.chdir('/')\nos.environ['X'] = '1'\nprint(os.getcwd())", limits=FAST)
    run_python("x = bytearray(10 * 2**30)")
    assert all_rlimits() == before_limits
    assert os.getcwd() == before_cwd and dict(os.environ) == before_env
    assert bytearray(300 * 2**20)  # the parent can still allocate beyond the child's memory limit


def test_concurrent_runs_from_threads():
    # Envs may run in a thread pool; each run must still get its own process, directory and result.
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda n: run_python(f"open('n', 'w').write('{n}')\nprint(open('n').read())"), range(6)))
    assert [r.stdout for r in results] == [f"{n}\n" for n in range(6)]


def test_invalid_limits_are_config_errors():
    with pytest.raises(ConfigError, match="cpu_seconds"):
        SandboxLimits(cpu_seconds=0)
    with pytest.raises(ConfigError, match="max_processes"):
        SandboxLimits(max_processes=-1)


# ---------------------------------------------------------------------------
# the python tool and PythonToolEnv


def call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture
def fast_tool(monkeypatch):
    monkeypatch.setattr(python_tool, "TOOL_LIMITS", SandboxLimits(cpu_seconds=1, wall_seconds=2, max_output_bytes=4096))


def test_python_tool_returns_output_or_raises_a_readable_error(fast_tool):
    assert python(code="print(6 * 7)") == "42"
    with pytest.raises(python_tool.PythonToolError, match="ZeroDivisionError"):
        python(code="1 / 0")
    with pytest.raises(python_tool.PythonToolError, match="does not allow"):
        python(code="import socket\nsocket.socket()")


def test_python_tasks_have_integer_answers():
    rng = random.Random(0)
    tasks = [make_python_task(rng) for _ in range(50)]
    assert all(isinstance(t["answer"], int) and t["question"].endswith("?") for t in tasks)
    assert len({t["question"] for t in tasks}) > 40
    assert [make_python_task(random.Random(5)) for _ in range(2)] == [make_python_task(random.Random(5))] * 2
    primes = next(t for t in (make_python_task(random.Random(s)) for s in range(200)) if "prime" in t["question"])
    n = last_integer(primes["question"])
    assert primes["answer"] == sum(all(k % d for d in range(2, int(k**0.5) + 1)) for k in range(2, n))


def test_python_env_scores_answers_and_partial_credit(fast_tool):
    env = PythonToolEnv()
    assert "python" in env.system_prompt() and "<answer>" in env.system_prompt()
    env.reset(question="What is the sum of the squares of the integers from 1 to 10?", answer=385)
    step = env.step(call("print(sum(i * i for i in range(1, 11)))"))
    assert step.observation == "<tool_response>385</tool_response>" and not step.done
    assert env.step("<answer>The sum is 385.</answer>").reward == 1.0

    env = PythonToolEnv()
    env.reset(question="q", answer=385)
    env.step(call("print(384)"))
    assert env.step("<answer>1</answer>").reward == pytest.approx(0.2)

    env = PythonToolEnv()
    env.reset(question="q", answer=385)
    assert env.step("<answer>12</answer>").reward == 0.0


@pytest.mark.parametrize(
    "malicious",
    [
        "while True:\n    pass\n",
        "import os\nwhile True:\n    os.fork()\n",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n",
        "import time\ntime.sleep(100)\n",
        "x = bytearray(10 * 2**30)\n",
        "open('/tmp/tinkerless-sandbox-test-escape', 'w')\n",
    ],
)
def test_python_env_survives_malicious_tool_calls(fast_tool, malicious):
    env = PythonToolEnv()
    env.reset(question="How many primes are below 100?", answer=25)
    started = time.monotonic()
    bad = env.step(call(malicious))
    assert time.monotonic() - started < 4
    assert not bad.done and bad.observation.startswith("<tool_response>error: the program")
    assert env.calls[-1].ok is False
    good = env.step(call("print(sum(all(n % d for d in range(2, n)) for n in range(2, 100)))"))
    assert good.observation == "<tool_response>25</tool_response>"
    final = env.step("<answer>25</answer>")
    assert final.done and final.reward == 1.0
    assert not os.path.exists("/tmp/tinkerless-sandbox-test-escape")


def test_python_env_malicious_only_episode_gets_no_credit(fast_tool):
    env = PythonToolEnv()
    env.reset(question="q", answer=25)
    for _ in range(env.max_tool_calls):
        assert not env.step(call("import os\nos.fork()")).done
    last = env.step(call("print(25)"))
    assert last.done and last.reward == 0.0  # out of tool calls, nothing ran


def test_python_env_survives_a_cloudpickle_round_trip(fast_tool):
    env_cls = unpack_code(pack_code(PythonToolEnv))
    env = env_cls()
    env.reset(question="q", answer=42)
    assert env.step(call("print(6 * 7)")).observation == "<tool_response>42</tool_response>"
    restored = unpack_code(pack_code(env, name="PythonToolEnv instance"))
    assert restored.answer == 42 and len(restored.calls) == 1
    assert restored.step("<answer>42</answer>").reward == 1.0
