"""What a bubblewrap sandbox sees: the read-only mounts for a `Profile`, computed once per process.

Only the interpreter, its standard library (its own site-packages hidden under an empty
read-only tmpfs), the shared libraries they load (found with one `ldd` run), ld.so.cache
and the time-zone database, each mounted read-only at its own path, with the symlinks
along those paths (/lib -> usr/lib) recreated; plus what a profile adds (the tenant
code host: the tinkerless package and site-packages).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Iterator

from tinkerless.envs.sandbox.limits import SandboxUnavailable

CODE_PATH = "/sandbox/main.py"
ZONEINFO = ("/usr/share/zoneinfo",)


@dataclass(frozen=True)
class Profile:
    """What a sandbox sees besides the interpreter and its standard library."""

    name: str = "tool"
    read_only: tuple[str, ...] = ()  # extra host paths mounted read-only at the same place
    python_path: tuple[str, ...] = ()  # put on sys.path (e.g. the tinkerless source and a venv's site-packages)
    hide: tuple[str, ...] = field(default=())  # paths inside those mounts to cover with an empty read-only tmpfs


TOOL_PROFILE = Profile()


TOOL_PROFILE = Profile()


@dataclass(frozen=True)
class _Layout:
    interpreter: str
    mounts: list[str]
    read_roots: tuple[str, ...]


@functools.lru_cache(maxsize=8)
def layout(profile: Profile) -> _Layout:
    """The read-only mounts for a profile, computed once per process (it runs ldd once)."""
    interpreter = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib_dirs = {os.path.realpath(p) for p in (*_base_paths("stdlib", "platstdlib"), os.path.dirname(os.__file__)) if p}
    binds: set[str] = {interpreter, *stdlib_dirs}
    symlinks: dict[str, str] = {}
    libraries = _shared_libraries([interpreter, *_extension_modules(stdlib_dirs)])
    for library in libraries:
        for path in (os.path.dirname(library), os.path.dirname(os.path.realpath(library))):
            binds.add(_mirror(path, symlinks))
    for path in ("/etc/ld.so.cache", *ZONEINFO, *profile.read_only):
        if os.path.exists(path):
            binds.add(_mirror(path, symlinks))
    binds = _outermost(binds)
    mounts: list[str] = []
    # bwrap would create the parents of mount points with mode 0700, unreadable for the sandbox's uid.
    for parent in _parents([*binds, *symlinks, CODE_PATH]):
        mounts += ["--perms", "0755", "--dir", parent]
    for path in sorted(binds):
        mounts += ["--ro-bind", path, path]
    for link, target in sorted(symlinks.items()):
        if not any(link == b or link.startswith(b.rstrip("/") + "/") for b in binds):
            mounts += ["--symlink", target, link]
    hidden = set(profile.hide) | {p for p in _site_packages() if any(p.startswith(d + "/") for d in stdlib_dirs)}
    hidden -= {os.path.realpath(p) for p in profile.python_path}
    for path in sorted(hidden):
        # Only what a mount would otherwise show (e.g. a server's storage inside a bound directory).
        if os.path.isdir(path) and any(path.startswith(b.rstrip("/") + "/") for b in binds):
            mounts += ["--tmpfs", path, "--remount-ro", path]
    read_roots = tuple(sorted(stdlib_dirs | set(ZONEINFO) | {os.path.realpath(p) for p in (*profile.read_only, *profile.python_path)}))
    return _Layout(interpreter=interpreter, mounts=mounts, read_roots=read_roots)


def _mirror(path: str, symlinks: dict[str, str]) -> str:
    """Record the symlinks along `path` (so it resolves inside as outside); return its real path to bind."""
    current = "/"
    for part in [p for p in os.path.abspath(path).split("/") if p]:
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            symlinks[candidate] = os.readlink(candidate)
            current = _mirror(os.path.realpath(candidate), symlinks) if os.path.realpath(candidate) != candidate else candidate
        else:
            current = candidate
    return os.path.realpath(path)


def _parents(paths: list[str]) -> list[str]:
    """Every ancestor directory of `paths` (not "/"), outer ones first."""
    found = {os.path.dirname(p.rstrip("/")) for p in paths}
    for path in list(found):
        while path not in ("/", ""):
            found.add(path)
            path = os.path.dirname(path)
    found.discard("/")
    found.discard("")
    return sorted(found, key=lambda p: (p.count("/"), p))


def _outermost(paths: set[str]) -> set[str]:
    """Drop paths inside another path of the set: binding the outer one already covers them."""
    kept: set[str] = set()
    for path in sorted(paths, key=len):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.add(path)
    return kept


def _extension_modules(stdlib_dirs: set[str]) -> list[str]:
    found = []
    for directory in stdlib_dirs:
        dynload = os.path.join(directory, "lib-dynload")
        if os.path.isdir(dynload):
            found += [os.path.join(dynload, name) for name in os.listdir(dynload) if name.endswith(".so")]
    return found


_LDD_LINE = re.compile(r"(?:=>\s*)?(/\S+)\s+\(0x[0-9a-f]+\)")


def _shared_libraries(binaries: list[str]) -> set[str]:
    try:
        done = subprocess.run(["ldd", *binaries], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"cannot list the interpreter's shared libraries with ldd: {exc}", hint="install libc-bin (ldd)") from exc
    return {match.group(1) for match in _LDD_LINE.finditer(done.stdout)}


def _base_paths(*keys: str) -> Iterator[str]:
    """sysconfig paths of the base interpreter (in a venv, sysconfig alone answers with the venv's)."""
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix, "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix}
    for key in keys:
        path = sysconfig.get_path(key, vars=base)
        if path:
            yield os.path.realpath(path)


def _site_packages() -> Iterator[str]:
    return _base_paths("purelib", "platlib")


__all__ = ["CODE_PATH", "TOOL_PROFILE", "Profile", "layout"]
