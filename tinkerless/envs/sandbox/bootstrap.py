"""The program the sandboxed interpreter runs first: `python -I -S -B -u -c BOOTSTRAP CONFIG_LITERAL`.

In order, before any of the user's code:

1. as root inside a bubblewrap sandbox (bwrap started by root keeps only
   CAP_SETUID/CAP_SETGID for this step), drop to the call's own unprivileged uid/gid
   with no supplementary groups, which clears every capability; no_new_privs
   (set by bwrap) keeps them from coming back through exec;
2. read the program: a file, stdin (Modal) or, in a sandbox started ahead of time
   (warm.py), a pipe it waits on;
3. set the resource limits (RLIMIT_NPROC: the tasks the uid already has plus
   `max_processes`), then compile the program (a syntax error is an "error" result);
4. optionally install the audit-hook layer (`sys.addaudithook` plus replaced
   functions) that refuses forbidden operations with a readable message;
5. run the program as `__main__`, and map an uncaught exception that came from a
   limit to an exit code (see `limits.py`) so the parent can say which limit.

The audit hook is NOT a security boundary: it runs inside the attacker's own
interpreter and can be removed by it (tests/test_sandbox_attacks.py does exactly
that). It is kept because its refusals are readable ("sandbox: writing /etc/x is
not allowed") where the kernel's are bare EPERM/EACCES. The boundary is the
bubblewrap sandbox around this process.
"""

BOOTSTRAP = r'''
import sys


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


def _drop(config):
    """Step 1: drop root (bwrap started as root) to this sandbox's own uid, before anything else."""
    import posix

    drop_to = config.get("drop_to")
    if drop_to is not None:
        uid, gid = drop_to
        if posix.geteuid() == 0:  # (a Modal container may already run unprivileged)
            posix.setgroups([])
            posix.setresgid(gid, gid, gid)
            posix.setresuid(uid, uid, uid)
        if 0 in posix.getresuid() or 0 in posix.getresgid():
            posix.write(2, b"sandbox: could not drop root; refusing to run user code\n")
            posix._exit(125)


def _limit(config):
    import posix
    import resource

    # Set here rather than in a preexec_fn: Popen can then spawn bwrap with vfork, which stays cheap
    # in a parent that holds a large model. Lowering a limit needs no privilege; raising it back
    # needs CAP_SYS_RESOURCE, which nothing in the sandbox has.
    for name, soft, hard in config.get("rlimits", ()):
        which = getattr(resource, name)
        _, current = resource.getrlimit(which)
        if current != resource.RLIM_INFINITY:
            soft, hard = min(soft, current), min(hard, current)
        resource.setrlimit(which, (soft, hard))
    if config.get("nproc") is not None:
        # RLIMIT_NPROC counts every task of this uid; in our own PID namespace /proc shows exactly those.
        uid, own = posix.getuid(), 0
        for entry in posix.listdir("/proc"):
            if entry.isdigit():
                try:
                    if posix.stat("/proc/" + entry).st_uid == uid:
                        own += len(posix.listdir("/proc/%s/task" % entry))
                except OSError:
                    pass
        limit = own + config["nproc"]
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def _show_exception(exc, source, with_traceback):
    # Imported only when there is something to show: linecache and traceback cost ~10 ms of every start.
    import linecache
    import traceback

    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    traceback.print_exception(exc.__class__, exc, exc.__traceback__ if with_traceback else None)


def _receive(fd):
    """Read "<program bytes> <stdin bytes>\\n", the program and its stdin from `fd`; make the stdin fd 0."""
    import posix

    def read_exactly(size):
        chunks = []
        while size:
            chunk = posix.read(fd, min(size, 1 << 20))
            if not chunk:
                posix._exit(124)  # the parent gave up on this sandbox before using it
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    header = b""
    while not header.endswith(b"\n"):
        header += read_exactly(1)
    program_size, stdin_size = (int(x) for x in header.split())
    source = read_exactly(program_size).decode("utf-8", "surrogatepass")
    stdin = posix.memfd_create("stdin")
    data = read_exactly(stdin_size)
    while data:
        data = data[posix.write(stdin, data):]
    posix.lseek(stdin, 0, 0)
    posix.dup2(stdin, 0)
    posix.close(stdin)
    posix.close(fd)
    return source


def _main():
    import posix

    # The parent passes a Python literal (str, int, bool, None, lists): eval with no builtins is quicker than json.
    config = eval(sys.argv[1], {"__builtins__": {}})
    _drop(config)
    exit_forbidden, exit_memory, exit_file_size, exit_disk, exit_processes, exit_open_files = config["exit_codes"]
    if config["code"] is None:  # Modal: the program arrives on stdin ahead of its own input, after its length
        size = int(sys.stdin.buffer.readline())
        source = sys.stdin.buffer.read(size).decode("utf-8", "surrogatepass")
    elif config["code"].startswith("fd:"):  # a sandbox started ahead of time: program and stdin come down a pipe
        source = _receive(int(config["code"][3:]))
    else:
        with open(config["code"], encoding="utf-8", errors="surrogatepass") as f:
            source = f.read()
    _limit(config)  # after the wait for the program: a sandbox started ahead of time spends none of its limits idle
    try:
        code = compile(source, "main.py", "exec")
    except (SyntaxError, ValueError) as exc:
        _show_exception(exc, source, False)
        posix._exit(1)
    violation = _install(config) if config["audit_hook"] else None
    sys.argv = ["main.py"]
    sys.path.insert(0, config["work"])  # like `python main.py` run in the working directory
    # A fresh __main__ module (pickle and dataclasses look classes up there), without the bootstrap's globals.
    main = type(sys)("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    del config
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        status = 1
        errno = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
        if violation is not None and isinstance(exc, violation):
            status = exit_forbidden
        elif isinstance(exc, MemoryError):
            status = exit_memory
        elif errno == 27:  # EFBIG: RLIMIT_FSIZE
            status = exit_file_size
        elif errno == 28:  # ENOSPC: the work dir's tmpfs is full
            status = exit_disk
        elif errno == 11 or (isinstance(exc, RuntimeError) and str(exc) == "can't start new thread"):
            status = exit_processes  # EAGAIN from fork, or a thread the kernel refused: RLIMIT_NPROC
        elif errno == 24:  # EMFILE: RLIMIT_NOFILE
            status = exit_open_files
        try:
            _strip_bootstrap(exc)
            _show_exception(exc, source, True)
        except BaseException:
            posix.write(2, ("%s\n" % exc.__class__.__name__).encode())
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            posix._exit(status)


def _strip_bootstrap(exc):
    """Drop the bootstrap's own frames (the exec call, the audit hook) from the traceback."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != "<string>":
            frames.append(tb)
        tb = tb.tb_next
    for current, following in zip(frames, frames[1:] + [None]):
        current.tb_next = following
    exc.__traceback__ = frames[0] if frames else None


_main()
'''

__all__ = ["BOOTSTRAP"]
