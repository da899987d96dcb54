"""The audit-hook layer: `_install(config)`, source text the sandboxed interpreter runs before the user's code.

It refuses, with a readable message, what the sandbox forbids anyway: sockets,
forks beyond `max_processes`, exec, writes outside the work dir, reads outside it
and the standard library, ctypes, changing limits, signalling other processes.
A refusal raises `SandboxViolation` ("sandbox: ..."); the 16th stops the program.

It is NOT a security boundary: it runs inside the attacker's own interpreter, which
can remove it (tests/test_sandbox_attacks.py does, three lines in). The kernel
layer (bwrap.py) holds without it; this layer only makes the common refusals
readable where the kernel's would be a bare EPERM.
"""

AUDIT_HOOK = r'''
def _install(config):
    import _thread
    import posix
    import _posixsubprocess

    work = config["work"]
    max_processes = config["max_processes"]
    exit_forbidden = config["exit_codes"][0]
    read_roots = tuple(config["read_roots"] or (sys.prefix + "/lib/python%d.%d" % sys.version_info[:2], "/usr/share/zoneinfo"))
    read_files = frozenset(["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random", "/etc/localtime"])
    write_files = frozenset(["/dev/null"])
    max_violations = 16

    # Bound now, so a program that monkeypatches os or posixpath cannot change what the hook does.
    lstat, readlink, getcwd, getpid = posix.lstat, posix.readlink, posix.getcwd, posix.getpid
    getpgrp, getpgid, write_fd, hard_exit = posix.getpgrp, posix.getpgid, posix.write, posix._exit
    str_join, bytes_join, int_add = "".join, b"".join, int.__add__
    modules = sys.modules
    no_dir_fd = (None, -1, -100)  # -100 is AT_FDCWD
    violations = [0]
    slots = None
    if max_processes > 0:
        import mmap

        slots = mmap.mmap(-1, 8)  # shared with forked children

    class SandboxViolation(PermissionError):
        pass

    # Tracebacks then say just "SandboxViolation: sandbox: ...".
    SandboxViolation.__module__, SandboxViolation.__qualname__ = "builtins", "SandboxViolation"

    def deny(message):
        violations[0] += 1
        if violations[0] >= max_violations:
            write_fd(2, ("sandbox: stopped after %d forbidden operations; last: %s\n" % (violations[0], message)).encode())
            hard_exit(exit_forbidden)
        raise SandboxViolation("sandbox: " + message)

    # --- paths -------------------------------------------------------------

    def as_text(path):
        kind = type(path)
        if kind is str:
            return path
        if kind is bytes:
            return path.decode("utf-8", "surrogateescape")
        if isinstance(path, str):  # a subclass: copy the characters, ignore its methods
            return str_join((path,))
        if isinstance(path, bytes):
            return bytes_join((path,)).decode("utf-8", "surrogateescape")
        if isinstance(path, int):
            return "/proc/self/fd/%d" % int_add(path, 0)
        # pathlib is imported lazily (it costs ~10 ms of every run's start): a Path can only exist once it is.
        pathlib = modules.get("pathlib")
        if pathlib is not None and kind in (pathlib.PurePath, pathlib.PurePosixPath, pathlib.Path, pathlib.PosixPath):
            if kind.__fspath__ is pathlib.PurePath.__fspath__ and kind.__str__ is pathlib.PurePath.__str__:
                return as_text(pathlib.PurePath.__str__(path))
        # Another PathLike could answer differently when the real call converts it again.
        deny("paths of type %s are not allowed; pass a str" % kind.__name__)

    def resolve(text, base=None):
        """An absolute path with every symlink resolved (missing parts kept as written)."""
        if not text.startswith("/"):
            text = (base if base is not None else getcwd()) + "/" + text
        pending = text.split("/")[::-1]
        parts = []
        hops = 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if parts:
                    parts.pop()
                continue
            candidate = "/" + "/".join(parts + [name])
            try:
                mode = lstat(candidate).st_mode
            except (OSError, ValueError):
                parts.append(name)
                continue
            if mode & 0o170000 == 0o120000:
                hops += 1
                if hops > 40:
                    deny("too many levels of symbolic links in %r" % text)
                target = readlink(candidate)
                if target.startswith("/"):
                    parts = []
                pending.extend(target.split("/")[::-1])
            else:
                parts.append(name)
        return "/" + "/".join(parts)

    def inside(path, root):
        return path == root or path.startswith(root + "/")

    def base_of(dir_fd):
        if dir_fd in no_dir_fd:
            return None
        base = resolve(as_text(dir_fd))
        if not inside(base, work):
            deny("using a directory outside the working directory")
        return base

    def entry_of(text, base):
        """The directory entry itself (not what a final symlink points to)."""
        head, _, tail = text.rstrip("/").rpartition("/")
        if tail in ("", ".", "..") or "/" not in text.rstrip("/"):
            if tail in ("", ".", ".."):
                return resolve(text, base)
            head = "."
        return resolve(head or "/", base).rstrip("/") + "/" + tail

    def check_write(path, dir_fd=None):
        text = as_text(path)
        base = base_of(dir_fd)
        target = resolve(text, base)
        if target in write_files:
            return
        if target.startswith("/proc/%d/fd/pipe:[" % getpid()):
            return  # its own stdout/stderr, e.g. /dev/stdout
        if not (inside(target, work) and inside(entry_of(text, base), work)):
            deny("writing %s is not allowed; only the working directory %s is writable" % (text, work))

    def check_read(text, target):
        if inside(target, work) or target in read_files or inside(target, "/proc/%d" % getpid()):
            return
        for root in read_roots:
            if inside(target, root):
                return
        deny("reading %s is not allowed; only the working directory and the standard library are readable" % text)

    write_flags = posix.O_WRONLY | posix.O_RDWR | posix.O_CREAT | posix.O_TRUNC | posix.O_APPEND

    def on_open(args):
        path, mode, flags = args[0], args[1], args[2]
        if isinstance(path, int) and not isinstance(path, bool) and mode is not None:
            return  # open(fd): wraps a descriptor it already has
        text = as_text(path)
        if mode is None and not text.startswith("/") and ".." in text.split("/"):
            # os.open may carry a dir_fd the event does not show; without ".." it cannot climb out of it
            deny("os.open with '..' in a relative path is not allowed; use an absolute path")
        if flags & write_flags:
            check_write(path)
            return
        target = resolve(text)
        check_read(text, target)
        if mode is None and not inside(target, work):
            try:
                is_dir = lstat(target).st_mode & 0o170000 == 0o040000
            except (OSError, ValueError):
                is_dir = False
            if is_dir:  # a directory fd would be a dir_fd to write through
                deny("opening the directory %s is not allowed" % text)

    def on_symlink(args):
        target, link, dir_fd = as_text(args[0]), args[1], args[2]
        parts = target.split("/")
        if not (target.startswith("/") and inside(target, work) and ".." not in parts and "." not in parts):
            deny("symlinks must point inside the working directory by an absolute path without '..'")
        check_write(link, dir_fd)

    # --- processes, signals, limits ------------------------------------------

    def take_slot(what):
        if slots is None:
            deny("%s is not allowed: no new processes or threads (max_processes=0)" % what)
        used = int.from_bytes(slots[:8], "little")
        if used >= max_processes:
            deny("%s is not allowed: the limit of %d extra processes/threads is used up" % (what, max_processes))
        slots[:8] = (used + 1).to_bytes(8, "little")

    def own_group(pid):
        try:
            return pid in (0, getpid()) or getpgid(abs(pid)) == getpgrp()
        except OSError:
            return False

    def on_kill(args):
        if not own_group(args[0]):
            deny("signalling other processes is not allowed")

    def on_killpg(args):
        if args[0] not in (0, getpgrp()):
            deny("signalling other process groups is not allowed")

    def on_socket(args):
        if args[1] != 1:  # AF_UNIX: socketpair() for asyncio; connect/bind/sendto stay denied
            deny("network access is not allowed (socket)")

    blocked_imports = frozenset([
        "ctypes", "_ctypes", "_posixsubprocess", "_thread", "posix", "_testcapi", "_testinternalcapi",
        "_testbuffer", "_testmultiphase", "_testimportmultiple", "_testsinglephase", "_testclinic",
        "_xxsubinterpreters", "_xxinterpchannels", "_xxtestfuzz", "_sqlite3", "_dbm", "_gdbm",
        "readline", "_posixshmem", "_multiprocessing", "syslog",
    ])

    def on_import(args):
        if args[0] in blocked_imports:  # also catches reloading the modules patched below
            deny("importing %s is not allowed (native code or file access outside the hook)" % args[0])

    def always(message):
        def handler(args):
            deny(message)
        return handler

    program = always("running other programs is not allowed")
    network = always("network access is not allowed")
    handlers = {
        "open": on_open,
        "os.symlink": on_symlink,
        "os.remove": lambda a: check_write(a[0], a[1]),
        "os.rmdir": lambda a: check_write(a[0], a[1]),
        "os.mkdir": lambda a: check_write(a[0], a[2]),
        "os.rename": lambda a: (check_write(a[0], a[2]), check_write(a[1], a[3])),
        "os.link": lambda a: (check_write(a[0], a[2]), check_write(a[1], a[3])),
        "os.chmod": lambda a: check_write(a[0], a[2]),
        "os.chown": lambda a: check_write(a[0], a[3]),
        "os.utime": lambda a: check_write(a[0], a[3]),
        "os.truncate": lambda a: check_write(a[0]),
        "os.setxattr": lambda a: check_write(a[0]),
        "os.removexattr": lambda a: check_write(a[0]),
        "os.chflags": lambda a: check_write(a[0]),
        "os.lchflags": lambda a: check_write(a[0]),
        "shutil.rmtree": lambda a: check_write(a[0], a[1]),
        "os.fork": lambda a: take_slot("os.fork"),
        "os.forkpty": lambda a: take_slot("os.forkpty"),
        "_thread.start_new_thread": lambda a: None,  # counted by the replaced function below
        "os.exec": program,
        "os.posix_spawn": program,
        "os.spawn": program,
        "os.system": program,
        "os.startfile": program,
        "subprocess.Popen": program,
        "os.kill": on_kill,
        "os.killpg": on_killpg,
        "socket.__new__": on_socket,
        "socket.connect": network,
        "socket.bind": network,
        "socket.sendto": network,
        "socket.sendmsg": network,
        "socket.getaddrinfo": network,
        "socket.gethostbyname": network,
        "socket.gethostbyaddr": network,
        "socket.getnameinfo": network,
        "socket.sethostname": network,
        "import": on_import,
        "resource.setrlimit": always("changing resource limits is not allowed"),
        "resource.prlimit": always("changing resource limits is not allowed"),
        "fcntl.ioctl": always("ioctl is not allowed"),
        "gc.get_objects": always("gc.get_objects is not allowed"),
        "gc.get_referrers": always("gc.get_referrers is not allowed"),
        "gc.get_referents": always("gc.get_referents is not allowed"),
        "sqlite3.connect": always("sqlite3 is not allowed"),
    }
    lookup = handlers.get

    def hook(event, args):
        handler = lookup(event)
        if handler is not None:
            handler(args)
        elif event.startswith("ctypes."):
            deny("native code (ctypes) is not allowed")

    # --- functions that have no audit event ------------------------------------

    def denied(message):
        def function(*args, **kwargs):
            deny(message)
        return function

    def start_new_thread(function, args, kwargs=None):
        take_slot("starting a thread")
        return original_start(function, args, {} if kwargs is None else kwargs)

    original_start = _thread.start_new_thread if max_processes > 0 else None
    thread_stub = start_new_thread if max_processes > 0 else denied("threads are not allowed (max_processes=0)")
    _thread.start_new_thread = _thread.start_new = thread_stub
    if "threading" in sys.modules:
        sys.modules["threading"]._start_new_thread = thread_stub
    _posixsubprocess.fork_exec = denied("running other programs is not allowed")
    modules = [posix] + ([sys.modules["os"]] if "os" in sys.modules else [])
    for name in ("setsid", "setpgid", "setpgrp", "mkfifo", "mknod", "chroot", "setns", "unshare", "setpriority"):
        for module in modules:
            if hasattr(module, name):  # process-group escapes and file creation without audit events
                setattr(module, name, denied("os.%s is not allowed" % name))

    sys.addaudithook(hook)
    return SandboxViolation
'''

__all__ = ["AUDIT_HOOK"]
