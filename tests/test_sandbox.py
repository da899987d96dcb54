"""The Python sandbox runs what it should, stops what it must (and says which limit), and PythonToolEnv survives it.

Every run is a real bubblewrap sandbox (or, where a test says so, the opt-in process
sandbox); limits are kept small so the whole file stays fast. Adversarial code is in
tests/test_sandbox_attacks.py; this file covers behaviour and the tool's contract.
"""

from __future__ import annotations

import json
import logging
import os
import random
import resource
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tinkerless.envs import python_tool, sandbox
from tinkerless.envs.python_tool import PythonToolEnv, last_integer, make_python_task, python
from tinkerless.envs.sandbox import SandboxLimits, SandboxUnavailable, run_python
from tinkerless.envs.tools import ToolObservation
from tinkerless.errors import ConfigError
from tinkerless.wire import pack_code, unpack_code

pytestmark = pytest.mark.timeout(120)

FAST = SandboxLimits(cpu_seconds=1, wall_seconds=3)


def all_rlimits() -> dict[str, tuple[int, int]]:
    return {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource) if name.startswith("RLIMIT_")}


def processes_named(name: str) -> list[str]:
    """Host processes whose comm is `name`: sandboxed code marks its children so the host can look for them."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        found.append(entry)
            except OSError:
                continue
    return found


def host_temp_entries() -> set[str]:
    return {e for e in os.listdir(tempfile.gettempdir()) if e.startswith("tinkerless-sandbox")}


# ---------------------------------------------------------------------------
# normal code


def test_normal_code_prints_and_uses_its_own_directory():
    before = host_temp_entries()
    result = run_python(
        "import os\n"
        "with open('notes.txt', 'w') as f:\n"
        "    f.write('kept')\n"
        "os.mkdir('sub')\n"
        "with open('sub/data.txt', 'w') as f:\n"
        "    f.write('inner')\n"
        "print(open('notes.txt').read(), open('sub/data.txt').read(), sorted(os.listdir('.')))\n"
        "print(os.getcwd(), os.environ['HOME'])\n"
    )
    assert result.ok and result.reason == "ok" and result.exit_code == 0 and result.sandbox == "bwrap", result
    assert result.stdout.splitlines() == ["kept inner ['notes.txt', 'sub']", "/tmp /tmp"]
    assert host_temp_entries() == before, "the work dir is a tmpfs inside the sandbox, nothing on the host"


def test_each_run_gets_a_fresh_directory():
    run_python("open('left.txt', 'w').write('x')")
    second = run_python("import os; print(os.listdir('.'))")
    assert second.ok and second.stdout == "[]\n"


def test_the_sandbox_is_an_unprivileged_uid_in_its_own_namespaces():
    code = (
        "import os, socket\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(os.getuid(), os.getgid(), os.getgroups(), os.getpid())\n"
        "print(status['CapEff'].strip(), status['CapPrm'].strip(), status['NoNewPrivs'].strip(), status['Seccomp'].strip())\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(socket.gethostname(), sorted(os.listdir('/')))\n"
    )
    result = run_python(code, audit_hook=False)
    assert result.ok, result
    ids, caps, pids, host = result.stdout.splitlines()
    uid, gid, groups, pid = ids.split(" ", 3)[0], ids.split(" ", 3)[1], ids.split(" ", 3)[2], ids.rsplit(" ", 1)[1]
    assert uid != "0" and gid != "0" and groups == "[]"
    assert pid == "2"  # bwrap's init is PID 1 of a PID namespace of its own
    assert caps == "0000000000000000 0000000000000000 1 2"  # no capabilities, no_new_privs, seccomp filter mode
    assert pids == "['1', '2']", "no host process is visible"
    assert host.startswith("sandbox ") and "'home'" not in host and "'work'" not in host


def test_the_root_holds_the_standard_library_but_no_site_packages_or_home():
    code = (
        "import json, sqlite3, ssl, decimal, zoneinfo\n"
        "import importlib.util, os, sys\n"
        "print(importlib.util.find_spec('torch'), importlib.util.find_spec('tinkerless'), importlib.util.find_spec('pytest'))\n"
        "print([p for p in sys.path if 'site-packages' in p or 'dist-packages' in p])\n"
        "print(os.path.exists(os.path.expanduser('~/.ssh')), os.path.exists('/home'), os.path.exists('/etc/passwd'))\n"
        "print(zoneinfo.ZoneInfo('Europe/Paris').key)\n"
    )
    result = run_python(code, audit_hook=False)
    assert result.ok, result
    assert result.stdout.splitlines() == ["None None None", "[]", "False False False", "Europe/Paris"]


def test_exception_reports_error_with_the_traceback():
    result = run_python("def f():\n    return 1 / 0\nf()\n")
    assert not result.ok and result.reason == "error" and result.exit_code == 1
    assert "ZeroDivisionError: division by zero" in result.stderr
    assert 'File "main.py", line 2, in f' in result.stderr and "<string>" not in result.stderr


def test_syntax_error_and_exit_codes():
    assert run_python("def (:\n").reason == "error"
    assert run_python("import sys\nsys.exit(3)").exit_code == 3
    assert run_python("import sys\nsys.exit(0)").ok


def test_stdin_is_passed():
    result = run_python("import sys\nprint(sys.stdin.read().upper())", stdin="hello")
    assert result.stdout == "HELLO\n"


def test_standard_library_works():
    code = (
        "import collections, itertools, fractions, math, re, json, heapq, bisect, statistics\n"
        "print(math.comb(10, 3), fractions.Fraction(1, 3) * 3, statistics.mean([1, 2, 3]))\n"
    )
    result = run_python(code)
    assert result.ok and result.stdout == "120 1 2\n", result


def test_output_is_truncated():
    result = run_python("print('x' * 100_000)", limits=SandboxLimits(max_output_bytes=1000))
    assert result.ok and result.truncated
    assert result.stdout.startswith("x" * 1000) and "[output truncated" in result.stdout


def test_endless_output_is_bounded():
    started = time.monotonic()
    result = run_python("while True:\n    print('spam' * 1000)\n", limits=SandboxLimits(cpu_seconds=1, wall_seconds=2, max_output_bytes=2048))
    assert result.reason in ("cpu_limit", "timeout") and result.truncated
    assert len(result.stdout) < 3000 and time.monotonic() - started < 4


# ---------------------------------------------------------------------------
# limits: each stops the run, and the result names it


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


def test_processes_are_limited_by_the_kernel_and_none_outlive_the_run():
    marker = f"tl{random.randrange(10**10)}"
    # Without the audit hook only RLIMIT_NPROC stands in the way of fork.
    denied = run_python("import os\nos.fork()\n", limits=FAST, audit_hook=False)
    assert denied.reason == "process_limit" and "BlockingIOError" in denied.stderr, denied
    code = (
        "import os, time\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        f"        open('/proc/self/comm', 'w').write({marker!r})\n"
        "        time.sleep(100)\n"
        "time.sleep(0.3)\n"
        "print('parent done')\n"
    )
    result = run_python(code, limits=SandboxLimits(max_processes=2, wall_seconds=5), audit_hook=False)
    assert result.ok and result.stdout == "parent done\n", result
    assert result.seconds < 2.5, "sleeping children must not hold the run open"
    time.sleep(0.2)
    assert processes_named(marker) == [], "the PID namespace dies with the run"
    third = run_python("import os\nfor _ in range(3):\n    os.fork()\n", limits=SandboxLimits(max_processes=2), audit_hook=False)
    assert third.reason == "process_limit", third


def test_threads_are_processes_for_the_limit():
    result = run_python("import _thread\n_thread.start_new_thread(print, ())\n", audit_hook=False)
    assert result.reason == "process_limit", result
    hooked = run_python("import threading\nthreading.Thread(target=print).start()\n")
    assert hooked.reason == "forbidden" and "threads are not allowed" in hooked.stderr


def test_huge_allocation_is_a_memory_limit():
    result = run_python("x = bytearray(10 * 2**30)\n", limits=FAST)
    assert result.reason == "memory_limit" and "MemoryError" in result.stderr
    slow = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(2**20))\n", limits=FAST)
    assert slow.reason == "memory_limit", slow


def test_file_size_and_disk_limits():
    big_file = run_python("open('big.bin', 'wb').write(b'x' * 2**20 * 2)\n", limits=SandboxLimits(max_file_bytes=2**20))
    assert big_file.reason == "file_limit", big_file
    many_files = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 2**19)\n"
    full = run_python(many_files, limits=SandboxLimits(max_file_bytes=2**20, disk_bytes=4 * 2**20), audit_hook=False)
    assert full.reason == "disk_limit" and "No space left" in full.stderr, full


def test_open_files_limit():
    result = run_python("files = [open('/dev/null') for _ in range(1000)]\n", audit_hook=False)
    assert result.reason == "open_files_limit", result


def test_parent_process_is_unaffected():
    before_limits, before_cwd, before_env = all_rlimits(), os.getcwd(), dict(os.environ)
    run_python("import os\nos.chdir('/')\nos.environ['X'] = '1'\nprint(os.getcwd())", limits=FAST)
    run_python("x = bytearray(10 * 2**30)")
    assert all_rlimits() == before_limits
    assert os.getcwd() == before_cwd and dict(os.environ) == before_env
    assert bytearray(300 * 2**20)  # the parent can still allocate beyond the child's memory limit


def test_concurrent_runs_from_threads():
    # Envs may run in a thread pool; each run must still get its own sandbox, directory, uid and result.
    # Each may fork once: a shared uid would make concurrent runs use up each other's process budget.
    code = "import os, time\nopen('n', 'w').write('{n}')\npid = os.fork()\nif pid == 0:\n    os._exit(0)\nos.waitpid(pid, 0)\nprint(open('n').read(), os.listdir('.'))"
    limits = SandboxLimits(max_processes=1)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda n: run_python(code.format(n=n), limits=limits, audit_hook=False), range(6)))
    assert [r.stdout for r in results] == [f"{n} ['n']\n" for n in range(6)], results


def test_invalid_limits_are_config_errors():
    with pytest.raises(ConfigError, match="cpu_seconds"):
        SandboxLimits(cpu_seconds=0)
    with pytest.raises(ConfigError, match="wall_seconds"):
        SandboxLimits(wall_seconds=float("inf"))
    with pytest.raises(ConfigError, match="max_processes"):
        SandboxLimits(max_processes=-1)
    with pytest.raises(ConfigError, match="disk_bytes"):
        SandboxLimits(disk_bytes=0)
    with pytest.raises(ConfigError, match="unknown sandbox"):
        run_python("print(1)", sandbox="docker")
    with pytest.raises(TypeError):
        run_python(b"print(1)")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# no silent downgrade


def test_missing_bubblewrap_refuses_with_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="bubblewrap") as caught:
        run_python("print(1)")
    assert "apt-get install bubblewrap" in caught.value.hint and "process-unsafe" in caught.value.hint
    env = PythonToolEnv()
    env.reset(question="q", answer=1)
    with pytest.raises(SandboxUnavailable):  # ends the run: never a silently failing observation
        env.step(call("print(1)"))


def test_process_unsafe_only_by_name_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_warned_unsafe", type(sandbox._warned_unsafe)())
    with caplog.at_level(logging.WARNING, logger="tinkerless.sandbox"):
        first = run_python("print(6 * 7)", sandbox="process-unsafe")
        second = run_python("print(1)", sandbox="process-unsafe")
    assert first.stdout == "42\n" and first.sandbox == "process-unsafe" and second.ok
    warnings = [r for r in caplog.records if "process-unsafe" in r.getMessage()]
    assert len(warnings) == 1
    monkeypatch.setenv("TINKERLESS_SANDBOX", "process-unsafe")
    assert run_python("print(1)").sandbox == "process-unsafe"
    monkeypatch.setenv("TINKERLESS_SANDBOX", "nonsense")
    with pytest.raises(ConfigError, match="TINKERLESS_SANDBOX"):
        run_python("print(1)")


def test_process_unsafe_cleans_up_a_deep_tree():
    # The old cleanup (shutil.rmtree) recursed once per level and raised RecursionError out of run_python.
    from tinkerless.envs.sandbox.process_unsafe import _remove_tree

    # Not under pytest's tmp_path: pytest's own cleanup is shutil.rmtree, which this tree would crash.
    root = tempfile.mkdtemp(prefix="tinkerless-deep-tree-test-")
    try:
        fd = os.open(root, os.O_RDONLY)
        for _ in range(1500):  # deeper than the recursion limit and PATH_MAX; built with dir fds
            os.mkdir("d", dir_fd=fd)
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.close(fd)
    finally:
        _remove_tree(root)
    assert not os.path.exists(root)
    result = run_python("import os\nos.makedirs('d/' * 100)\nprint('made')", sandbox="process-unsafe")
    assert result.stdout == "made\n", result


# ---------------------------------------------------------------------------
# the python tool and PythonToolEnv


def call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture
def fast_tool(monkeypatch):
    monkeypatch.setattr(python_tool, "TOOL_LIMITS", SandboxLimits(cpu_seconds=1, wall_seconds=2, max_output_bytes=4096))


def test_python_tool_observation_has_output_status_and_limit(fast_tool):
    assert python(code="print(6 * 7)") == ToolObservation("42")
    failed = python(code="print('before')\n1 / 0")
    assert not failed.ok and failed.text.startswith("error: the program failed (exit status 1)")
    assert "[stdout]\nbefore" in failed.text and "ZeroDivisionError" in failed.text
    stopped = python(code="import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert not stopped.ok and "wall-clock limit" in stopped.text and "(timeout, killed by signal SIGKILL)" in stopped.text
    assert "started" in stopped.text
    memory = python(code="x = bytearray(2**33)")
    assert "memory limit 256 MiB" in memory.text and "memory_limit" in memory.text
    forbidden = python(code="import socket\nsocket.socket()")
    assert "does not allow" in forbidden.text and "network access is not allowed" in forbidden.text
    assert python(code="pass").text.startswith("(the program printed nothing")


def test_python_tool_names_its_sandbox():
    with pytest.raises(ConfigError, match="unknown sandbox"):
        python_tool.python_tool(sandbox="chroot")
    unsafe = python_tool.python_tool(sandbox="process-unsafe", limits=FAST)
    assert unsafe(code="print(2 + 2)").text == "4"


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
        "open('/etc/tinkerless-sandbox-test-escape', 'w')\n",
    ],
)
def test_python_env_survives_malicious_tool_calls(fast_tool, malicious):
    env = PythonToolEnv()
    env.reset(question="How many primes are below 100?", answer=25)
    started = time.monotonic()
    bad = env.step(call(malicious))
    assert time.monotonic() - started < 4
    assert not bad.done and bad.observation.startswith("<tool_response>error: the program"), bad.observation
    assert env.calls[-1].ok is False
    good = env.step(call("print(sum(all(n % d for d in range(2, n)) for n in range(2, 100)))"))
    assert good.observation == "<tool_response>25</tool_response>"
    final = env.step("<answer>25</answer>")
    assert final.done and final.reward == 1.0
    assert not os.path.exists("/etc/tinkerless-sandbox-test-escape")


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


# ---------------------------------------------------------------------------
# the Modal sandbox, offline at the SDK boundary: the one fake is `modal.Sandbox` and `modal.App.lookup`
# (Modal's network), standing in with a local process that runs the same command.


class FakeModalSandbox:
    """`modal.Sandbox` where calls would leave the machine: `create` records its arguments and runs the command
    as a local process; stdin/stdout/stderr/poll/terminate as Modal's."""

    created: list[dict] = []

    def __init__(self, argv: list[str], options: dict):
        import subprocess

        self.options = options
        # The image is Debian with this Python version: here, Debian's own /usr/bin/python3 (its stdlib is
        # world-readable, as in the image, for the uid the bootstrap drops to).
        assert argv[0] == "python3"
        self.proc = subprocess.Popen(["/usr/bin/python3", *argv[1:]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/tmp", env={})
        self.stdin = _FakeWriter(self.proc.stdin)
        self.stdout, self.stderr = _FakeReader(self.proc.stdout), _FakeReader(self.proc.stderr)

    @classmethod
    def create(cls, *argv: str, app=None, image=None, **options):
        assert app == "app-handle" and image is not None
        cls.created.append(options)
        return cls(list(argv), options)

    def poll(self):
        return self.proc.poll()

    @property
    def returncode(self):
        return self.proc.returncode

    def terminate(self):
        self.proc.kill()
        self.proc.wait()


class _FakeWriter:
    def __init__(self, pipe):
        self.pipe = pipe

    def write(self, data):
        self.pipe.write(data if isinstance(data, bytes) else data.encode())

    def write_eof(self):
        self.pipe.close()

    def drain(self):
        pass


class _FakeReader:
    def __init__(self, pipe):
        self.pipe = pipe

    def __iter__(self):
        for chunk in iter(lambda: self.pipe.read1(4096), b""):
            yield chunk.decode("utf-8", "replace")  # Modal's readers yield text by default


@pytest.fixture
def fake_modal(monkeypatch):
    import modal

    from tinkerless.envs.sandbox import modal_sandbox

    modal_sandbox._app_and_image.cache_clear()
    monkeypatch.setattr(modal.App, "lookup", staticmethod(lambda name, create_if_missing=False: "app-handle" if create_if_missing and name == modal_sandbox.APP_NAME else None))
    monkeypatch.setattr(modal, "Sandbox", FakeModalSandbox)
    FakeModalSandbox.created = []
    yield FakeModalSandbox
    modal_sandbox._app_and_image.cache_clear()


def test_modal_sandbox_runs_the_bootstrap_with_the_limits_and_no_network(fake_modal):
    limits = SandboxLimits(cpu_seconds=1, wall_seconds=3, memory_bytes=128 * 2**20)
    result = run_python("import os, sys\nprint(6 * 7, os.getuid(), sys.stdin.read())", limits=limits, stdin="from stdin", sandbox="modal")
    assert result.ok and result.sandbox == "modal" and result.stdout == "42 65534 from stdin\n", result
    assert fake_modal.created == [{"timeout": 8, "cpu": 1.0, "memory": 256, "block_network": True, "workdir": "/tmp"}]
    networked = SandboxLimits(network=True, max_processes=1)
    assert run_python("print(1)", limits=networked, sandbox="modal").ok
    assert fake_modal.created[-1]["block_network"] is False and fake_modal.created[-1]["memory"] == 256 * 2 + 128


def test_modal_sandbox_limits_mean_what_they_mean_locally(fake_modal):
    slow = run_python("import time\nprint('start', flush=True)\ntime.sleep(30)", limits=SandboxLimits(wall_seconds=1), sandbox="modal")
    assert slow.reason == "timeout" and slow.stdout == "start\n" and slow.seconds < 3
    memory = run_python("x = bytearray(2**33)", limits=FAST, sandbox="modal")
    assert memory.reason == "memory_limit", memory
    fork = run_python("import os\nos.fork()", limits=FAST, sandbox="modal", audit_hook=False)
    assert fork.reason == "process_limit", fork
    tool = python_tool.python_tool(sandbox="modal", limits=FAST)
    failed = tool(code="1 / 0")
    assert not failed.ok and "ZeroDivisionError" in failed.text and "exit status 1" in failed.text


def test_modal_sandbox_without_modal_access_refuses(monkeypatch):
    import modal

    from tinkerless.envs.sandbox import modal_sandbox

    modal_sandbox._app_and_image.cache_clear()

    def no_token(*args, **kwargs):
        raise modal.exception.AuthError("Token missing")

    monkeypatch.setattr(modal.App, "lookup", staticmethod(no_token))
    try:
        with pytest.raises(SandboxUnavailable, match="cannot reach Modal") as caught:
            run_python("print(1)", sandbox="modal")
        assert "sandbox='bwrap'" in caught.value.hint
    finally:
        modal_sandbox._app_and_image.cache_clear()


def test_bubblewrap_never_grants_network():
    with pytest.raises(ConfigError, match="no network"):
        run_python("print(1)", limits=SandboxLimits(network=True))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"), reason="needs root to become another user")
def test_a_non_root_worker_gets_the_same_sandbox_through_a_user_namespace():
    """As root the interpreter drops to a leased uid; as anyone else bwrap maps uid 65534 in a user namespace.
    Run the second path for real: Debian's python3 as user nobody, with this checkout's package on its path."""
    import subprocess

    # A copy nobody can read: the checkout may sit below a directory only root may enter (mktemp -d is 0700).
    checkout = tempfile.mkdtemp(prefix="tinkerless-nobody-")
    os.chmod(checkout, 0o755)
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tinkerless")
    shutil.copytree(package, os.path.join(checkout, "tinkerless"), ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(checkout):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from tinkerless.envs.sandbox import run_python, SandboxLimits\n"
        "r = run_python('import os; print(os.getuid(), os.getpid(), sorted(os.listdir(\"/\")))')\n"
        "print(r.reason, r.stdout.strip())\n"
        "print(run_python('import os\\nos.fork()', audit_hook=False).reason)\n"
        "print(run_python('import os\\nos.fork()\\nprint(1)', limits=SandboxLimits(max_processes=1), audit_hook=False).stdout.count('1'))\n"
    ) % checkout
    done = subprocess.run(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/usr/bin/python3", "-c", script],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/tmp",
    )
    shutil.rmtree(checkout, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    first, fork_denied, fork_allowed = done.stdout.splitlines()
    assert first.startswith("ok 65534 2 ") and "'root'" not in first and "'home'" not in first
    assert fork_denied == "process_limit" and fork_allowed == "2"  # parent and child both printed


def test_the_seccomp_filter_is_the_same_from_every_source():
    """Imported bindings, Debian's module loaded by path, or /usr/bin/python3 in a subprocess: one program."""
    from tinkerless.envs.sandbox import seccomp_filter

    module = seccomp_filter._import_seccomp()
    assert module is not None, "libseccomp's Python bindings are missing: apt-get install python3-seccomp"
    direct = seccomp_filter.build_filter(module)
    assert len(direct) > 100 and direct == seccomp_filter.compiled_filter()
    if os.path.exists(seccomp_filter.SYSTEM_PYTHON):
        assert seccomp_filter._build_with_system_python() == direct
