"""User code by value: cloudpickle bytes tagged with the Python version that made them."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import sysconfig
from typing import Any

import cloudpickle

from tinkerless.errors import ProtocolError, UserCodeError
from tinkerless.wire.codec import PYTHON_VERSION


# Installed code (stdlib, site-packages) is importable on the worker too, so it is pickled by reference.
_INSTALLED_PREFIXES = tuple(
    os.path.realpath(p)
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {sys.base_prefix}
)


@dataclasses.dataclass
class CodeBlob:
    """A cloudpickled callable or class. `python` is "major.minor" of the pickler."""

    name: str
    python: str
    payload: bytes


def _register_user_module(obj: Any) -> None:
    # Code from the user's own files (not an installed package) must travel by
    # value: the remote side has no copy of the user's module to import.
    module = inspect.getmodule(obj)
    if module is None or module.__name__ in ("__main__", "builtins"):
        return
    root = module.__name__.split(".")[0]
    if root == "tinkerless" or root in sys.stdlib_module_names:
        return
    file = os.path.realpath(getattr(module, "__file__", "") or "")
    if "site-packages" in file or "dist-packages" in file or file.startswith(_INSTALLED_PREFIXES):
        return
    try:
        cloudpickle.register_pickle_by_value(module)
    except ValueError:
        pass  # not in sys.modules under that name; cloudpickle pickles it by value anyway


def pack_code(obj: Any, *, name: str | None = None) -> CodeBlob:
    """Pickle user code by value, with an error that names the culprit if it cannot be."""
    label = name or getattr(obj, "__qualname__", None) or repr(obj)
    _register_user_module(obj)
    try:
        payload = cloudpickle.dumps(obj)
    except Exception as exc:
        raise UserCodeError(
            f"cannot package {label!r} to send it to the workers: {type(exc).__name__}: {exc}",
            hint="user code is shipped by value with cloudpickle; move unpicklable objects "
            "(open files, locks, sockets, live models, DB connections) inside the function or "
            "create them in reset()",
        ) from exc
    return CodeBlob(name=label, python=PYTHON_VERSION, payload=payload)


def unpack_code(blob: CodeBlob) -> Any:
    """Rebuild user code, refusing a pickle made by another Python minor version."""
    if blob.python != PYTHON_VERSION:
        raise ProtocolError(
            f"{blob.name!r} was pickled under Python {blob.python} but this worker runs Python "
            f"{PYTHON_VERSION}",
            hint=f"run the client with Python {PYTHON_VERSION}, or deploy workers with Python {blob.python}",
        )
    try:
        return cloudpickle.loads(blob.payload)
    except Exception as exc:
        raise UserCodeError(
            f"cannot unpack {blob.name!r} on the worker: {type(exc).__name__}: {exc}",
            hint="the code imports a module the worker lacks; install it on the worker image or "
            "import it inside the function",
        ) from exc
