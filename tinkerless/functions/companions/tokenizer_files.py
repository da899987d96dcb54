"""A companion model's tokenizer as files and back: how it crosses from where the model is loaded (a server's
extra model, a Modal container) to the client that aligns a teacher of another vocabulary with it.

The files are what `save_pretrained` writes from the tokenizer that process loaded, so the client tokenizes and
renders chat templates with exactly the tokenizer that scores, downloads nothing (it may have no hub access, and
a model named by a directory exists only where it was loaded), and never meets another version of it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from tinkerless.errors import ProtocolError

MAX_FILES = 32
MAX_BYTES = 64 * 1024 * 1024  # a large vocabulary's tokenizer.json is tens of MB at most


def tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    """{file name: bytes} of `tokenizer` as `save_pretrained` writes it."""
    with tempfile.TemporaryDirectory(prefix="tinkerless-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def tokenizer_from_files(files: Any, *, source: str) -> Any:
    """The tokenizer `tokenizer_files` gave, rebuilt here; files that are not a tokenizer's are a `ProtocolError`
    naming `source`."""
    from transformers import AutoTokenizer

    ok = isinstance(files, dict) and 0 < len(files) <= MAX_FILES and all(
        isinstance(name, str) and isinstance(content, bytes) and Path(name).name == name
        and name not in ("", ".", "..") for name, content in files.items())
    if not ok or sum(len(c) for c in files.values()) > MAX_BYTES:
        raise ProtocolError(f"{source} sent no tokenizer files (plain file names and bytes, at most {MAX_FILES} files "
                            f"and {MAX_BYTES >> 20} MB)", hint="check that it runs the same tinkerless version")
    with tempfile.TemporaryDirectory(prefix="tinkerless-tokenizer-") as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_bytes(content)
        return AutoTokenizer.from_pretrained(tmp)
