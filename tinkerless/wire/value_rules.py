"""Rules for one field's value, shared by the wire's validators (`validate`, `run_calls`): each
`rule(value, path)` returns quietly or raises `InvalidRequest` (HTTP 400, category "user") naming the field."""

from __future__ import annotations

from typing import Any, Callable

from tinkerless.errors import InvalidRequest


def fail(path: str, message: str, hint: str | None = None) -> None:
    raise InvalidRequest(f"{path} {message}", hint=hint or "fix the value in the request (see docs/errors.md)")


def between(low: float | None = None, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    def rule(value: Any, path: str) -> None:
        if value is None:
            return
        too_low = low is not None and (value <= low if low_open else value < low)
        too_high = high is not None and (value >= high if high_open else value > high)
        if too_low or too_high:
            lo = "" if low is None else f"{'(' if low_open else '['}{low}"
            hi = "" if high is None else f"{high}{')' if high_open else ']'}"
            fail(path, f"is {value!r}, out of range {lo or '(-inf'}, {hi or 'inf)'}")

    return rule


def non_empty(value: Any, path: str) -> None:
    if not value:
        fail(path, "must not be empty")


def one_of(*choices: str) -> Callable[[Any, str], None]:
    def rule(value: Any, path: str) -> None:
        if value not in choices:
            fail(path, f"is {str(value)[:40]!r}, not one of {', '.join(map(repr, choices))}")

    return rule


def endpoint_url(value: Any, path: str) -> None:
    if value is not None and (not value.startswith(("http://", "https://")) or len(value) > 2000
                              or any(c.isspace() or ord(c) < 32 for c in value)):
        fail(path, f"is {str(value)[:60]!r}, not an http(s) URL", "e.g. http://127.0.0.1:8000/v1")


def bounded_text(most: int) -> Callable[[Any, str], None]:
    def rule(value: Any, path: str) -> None:
        if value is not None and (not value.strip() or len(value) > most):
            fail(path, f"must be non-empty text of at most {most} characters")

    return rule


def tagged(module: str, name: str) -> Callable[[Any, str], None]:
    def rule(value: Any, path: str) -> None:
        if (type(value).__module__, type(value).__qualname__) != (module, name):
            fail(path, f"must be a {name}, got {type(value).__name__}")

    return rule
