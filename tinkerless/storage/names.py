"""Names that become storage keys or file names: one validator for run ids, checkpoint names, policy and tenant names.

Every name a client sends that ends up in a key (`tenants/<tenant>/runs/<run_id>/checkpoints/...`, a Tinker
checkpoint `weights/<name>`, a policy's files `policies/<name>/`) goes through `check_name` with its kind's
`NameRule`. One alphabet for all of them, ASCII letters, digits and a kind's few punctuation marks, rules out
at once what must never reach storage:

- path shapes: '/', '\\', '.' and '..' (a name starts with a letter or digit, or '_' where the kind allows);
- NUL and every other control or format character (newlines, escapes, the right-to-left override);
- Unicode look-alikes of those ('․․', '／', '∕'), which some filesystems and tools fold into the real ones;
- length: at most the kind's maximum, and never more than a file name's 255 bytes.

The refusal says which of these the name broke, in the caller's terms. `ObjectStore.validate_key` is the
second wall: whatever reaches storage is checked again, part by part.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from tinkerless.errors import InvalidRequest

MAX_NAME_BYTES = 255  # a file name on every filesystem and object store tinkerless writes to


@dataclass(frozen=True)
class NameRule:
    what: str  # "run id", as the error message names it
    max_length: int
    punctuation: str = "._-"  # allowed besides ASCII letters and digits
    first: str = ""  # punctuation also allowed as the first character
    example: str = "my-run-01"

    def __post_init__(self) -> None:
        assert self.max_length <= MAX_NAME_BYTES

    @property
    def pattern(self) -> re.Pattern:
        rest = re.escape(self.punctuation)
        return re.compile(f"[A-Za-z0-9{re.escape(self.first)}][A-Za-z0-9{rest}]{{0,{self.max_length - 1}}}")

    @property
    def hint(self) -> str:
        marks = ", ".join(f"'{c}'" for c in self.punctuation)
        start = "a letter or digit" + (f" (or {', '.join(repr(c) for c in self.first)})" if self.first else "")
        return (f"use 1-{self.max_length} ASCII letters, digits and {marks}, starting with {start} "
                f"(e.g. {self.example!r})")


RUN_ID = NameRule("run id", 128, example="gsm8k-grpo-01")
CHECKPOINT_NAME = NameRule("checkpoint name", 128, example="step-10")
POLICY_NAME = NameRule("policy name", 200, punctuation="_-", first="_-", example="default")
TENANT_NAME = NameRule("tenant name", 64, punctuation="_-", example="alice")
FILE_NAME = NameRule("file name", 200, first="_-", example="client.json")  # one part of a checkpoint file's key


def check_name(value: Any, rule: NameRule, *, where: str | None = None) -> str:
    """`value` unchanged when it is a valid name of `rule`'s kind; else `InvalidRequest` (400, category user)
    saying what is wrong with it. `where` names the field (default: the kind)."""
    field = f"{where}: " if where and where != rule.what else ""
    if not isinstance(value, str):
        raise InvalidRequest(f"{field}invalid {rule.what}: must be a string, got {type(value).__name__}", hint=rule.hint)
    problem = _problem(value, rule)
    if problem is not None:
        shown = value[:64].encode("unicode_escape").decode("ascii") + ("..." if len(value) > 64 else "")
        raise InvalidRequest(f"{field}invalid {rule.what} '{shown}': {problem}", hint=rule.hint)
    return value


def _problem(value: str, rule: NameRule) -> str | None:
    if not value:
        return "it is empty"
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > rule.max_length:
        return f"it is {size} bytes long, over {rule.max_length}"
    control = next((c for c in value if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), None)
    if control is not None:
        return f"it contains the control character U+{ord(control):04X}"
    if "/" in value or "\\" in value:
        return "it contains a path separator"
    if value in (".", "..") or value.startswith("."):
        return "it is shaped like a path ('.' or '..')"
    foreign = next((c for c in value if not c.isascii()), None)
    if foreign is not None:
        return f"it contains the non-ASCII character {foreign!r} (U+{ord(foreign):04X})"
    if not rule.pattern.fullmatch(value):
        return "it holds a character outside the allowed ones, or starts with one a name may not start with"
    return None


def check_file_key(value: Any, *, where: str, allow_empty: bool = False, trailing_slash: bool = False) -> str:
    """A relative key of file names ('adapter/adapter_config.json', a policy's prefix 'policies/a/'), each part
    checked as a `FILE_NAME`. With `trailing_slash` the key is a prefix: '' or parts ending in '/'."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: must be a string, got {type(value).__name__}", hint=FILE_NAME.hint)
    if value == "" and allow_empty:
        return value
    body = value
    if trailing_slash:
        if not value.endswith("/"):
            raise InvalidRequest(f"{where}: {value[:64]!r} must be empty or end with '/'",
                                 hint="a file prefix is a folder such as 'policies/black/'")
        body = value[:-1]
    if len(value.encode("utf-8", "surrogatepass")) > 1024:
        raise InvalidRequest(f"{where}: {len(value)} characters long, over 1024", hint="use a shorter key")
    for part in body.split("/"):
        check_name(part, FILE_NAME, where=f"{where} part")
    return value
