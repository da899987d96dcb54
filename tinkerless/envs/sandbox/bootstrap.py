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

from tinkerless.envs.sandbox.audit_hook import AUDIT_HOOK

# The program is the audit hook's source and the boot sequence below, run with `python -c`.
BOOTSTRAP = "import sys\n\n\n" + AUDIT_HOOK + "\n\n" + r'''
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
