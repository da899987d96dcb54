"""Schema-driven hostile values: for every field of every wire dataclass, values drawn from its annotation.

`field_paths(template)` walks a valid request down to its leaves and yields, for each field, map entry
and list element, its access path and the annotation it is declared with. `hostile_for(hint)` draws the
values a careless or hostile client sends for a field of that type:

- None (every field, optional or not);
- the wrong type (a string for a number, a number for a string, a map for a list, a list for a map);
- NaN and +-inf, for numbers;
- integers at and beyond 2**63 (and 2**64 - 1, the largest msgpack carries);
- empty, huge, control-character, path-shaped and Unicode look-alike strings;
- nested lists of the wrong shape.

Nothing here names a field: a field added to a wire message later is fuzzed without anyone writing a
case (tests/test_schema_fuzz.py).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

import numpy as np
from hypothesis import strategies as st

PATH_SHAPED = ["..", "../x", "../../server/api_keys.json", "/etc/passwd", "a/b", "a\\b", "./a", "~/x", "a/../../b",
               "%2e%2e%2f", "C:\\x"]
CONTROL = ["", " ", "\x00", "x\x00y", "x\n", "\r\nx", "\x1b[31m", "\t", "\u202e", "\ufeffx"]
LOOK_ALIKES = ["\u2024\u2024", "\uff0e\uff0e\uff0fx", "a\u2215b", "a\u2044b", "\uff41", "é", "\u0430dmin"]
HUGE = ["a" * 256, "a" * 4096, "é" * 200, "a" * 200_000]
BIG_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -(2**63) + 1, -1]
NON_FINITE = [float("nan"), float("inf"), -float("inf"), 1e308, -1e308]
WRONG_SHAPES = [[], [None], [[None]], [[1, 2], [3]], [[[1]]], [{}], [[]], {"a": [1]}, [1, "x", None]]

strings = st.sampled_from(PATH_SHAPED + CONTROL + LOOK_ALIKES + HUGE) | st.text(max_size=20)
numbers = st.sampled_from(BIG_INTS + NON_FINITE + [0, -0.0, 0.5, 1e-320]) | st.integers(-(2**64), 2**64)
wrong_shapes = st.sampled_from(WRONG_SHAPES)


def hostile_for(hint: Any) -> st.SearchStrategy:
    """Values a field annotated `hint` must refuse (or take, when they happen to be valid)."""
    common = st.none() | wrong_shapes
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        return st.one_of(*(hostile_for(o) for o in options))
    if hint in (int, float):
        return common | numbers | strings | st.sampled_from([True, b"\x01", {"x": 1}])
    if hint is str:
        return common | strings | numbers | st.sampled_from([b"bytes", True])
    if hint is bool:
        return common | st.sampled_from([0, 1, 2, "true", "", 1.0, float("nan")])
    if hint is bytes:
        return common | strings | st.sampled_from([0, b"", b"\xff" * 3])
    if hint is np.ndarray:
        return common | st.sampled_from([
            np.array([1.0, float("nan")]), np.zeros((2, 2), np.int64), np.array([2**40], np.int64),
            np.array([], np.float32), np.array([-1, 3], np.int32), np.array([b"x"]), np.zeros(3, np.complex64),
        ]) | numbers
    if origin is list or hint is list:
        (item,) = typing.get_args(hint) or (Any,)
        element = hostile_for(item) if item is not Any else strings | numbers | st.none()
        return common | strings | numbers | st.lists(element, min_size=1, max_size=3)
    if origin is dict or hint is dict:
        args = typing.get_args(hint) or (str, Any)
        return common | strings | numbers | st.sampled_from([{1: "int key", "s": 2}, {0: None}, {"a": b"\xff"}]) \
            | st.dictionaries(
            st.sampled_from(["", "..", "a/b", "\x00", "__dc__", "x" * 300]) | st.text(max_size=4),
            hostile_for(args[1]) if args[1] is not Any else strings | numbers | st.none(), min_size=1, max_size=2)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return common | strings | numbers | st.sampled_from([{"x": 1}, {}])
    return common | strings | numbers  # Any: plain data of any kind


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_paths(value: Any, hint: Any = None, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, annotation) of every field, map entry and list element inside `value`."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        hints = _hints(type(value))
        for f in dataclasses.fields(value):
            field_hint = hints.get(f.name, Any)
            yield prefix + (f.name,), field_hint
            yield from field_paths(getattr(value, f.name), field_hint, prefix + (f.name,))
        return
    hint = _strip_optional(hint)
    origin = typing.get_origin(hint)
    if isinstance(value, list):
        (item,) = typing.get_args(hint) or (Any,) if origin is list else (Any,)
        for i, element in enumerate(value):
            yield prefix + (i,), _strip_optional(item)
            yield from field_paths(element, item, prefix + (i,))
    elif isinstance(value, dict):
        item = typing.get_args(hint)[1] if origin is dict and typing.get_args(hint) else Any
        for key, element in value.items():
            yield prefix + (key,), _strip_optional(item)
            yield from field_paths(element, item, prefix + (key,))


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if len(options) == 1:
            return options[0]
    return hint


def replaced(value: Any, path: tuple, new: Any) -> Any:
    """A copy of `value` with the element at `path` set to `new` (frozen dataclasses too)."""
    from fuzz_cases import _replace

    return _replace(value, path, new)


def wire_dataclasses() -> list[type]:
    """Every dataclass a client can send: the wire modules' own, and the loss config they carry."""
    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire import code, content, messages, runs

    found = [LossConfig]
    for module in (messages, runs, code, content):
        found += [obj for obj in vars(module).values()
                  if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__]
    return found


# ---- every msgpack route, and requests drawn from the schema (tests/test_schema_fuzz.py, bench/fuzz.py) -------


class Duel:
    """A valid two-seat env, so that rollout_multi's template is a request the server really runs."""

    agents = ("a", "b")

    def reset(self, **task) -> None:
        self.moves = 0

    def turn(self):
        return None if self.moves >= 2 else ("a", "b")[self.moves % 2]

    def observation(self, agent: str) -> str:
        return f"move {self.moves}"

    def step(self, agent: str, action: str):
        import tinkerless

        self.moves += 1
        return tinkerless.MultiStepResult(rewards={agent: 1.0})


def routes(target) -> dict[str, object]:
    """path -> a valid request of that route's type, for every msgpack route."""
    from fuzz_cases import POLICY, call_templates, run_templates

    from tinkerless.wire import pack_code
    from tinkerless.wire.messages import DeletePolicyRequest, MultiAgentRolloutRequest, Seat

    calls = call_templates()
    multi = calls["rollout_multi"]
    calls["rollout_multi"] = MultiAgentRolloutRequest(
        [{}], 1, pack_code(Duel), {"a": Seat(POLICY), "b": Seat("base", trainable=False)}, multi.sampling,
        multi.limits, 0)
    calls["delete_policy"] = DeletePolicyRequest("fz-gone")
    out = {f"/v1/call/{m}": body for m, body in calls.items() if m != "info"}
    out.update(image_templates())
    out.update(run_templates(target))
    return out


def image_templates() -> dict[str, object]:
    """Requests that carry images (content parts in tasks and messages, processed images in datums), under the
    routes that take them; the fragment after '#' tells the templates apart and never reaches the server."""
    import io

    from fuzz_cases import POLICY, _datum
    from PIL import Image

    from tinkerless.functions.losses import LossConfig
    from tinkerless.wire.content import ImagePart, TextPart, VisionInput
    from tinkerless.wire.messages import EpisodeLimits, ForwardRequest, RolloutRequest, SamplingParams, UpdateRequest

    buffer = io.BytesIO()
    Image.new("RGB", (6, 4), (200, 10, 10)).save(buffer, format="PNG")
    image = ImagePart(buffer.getvalue(), "image/png")
    tasks = [{"prompt": "which colour?", "images": [image]},
             {"messages": [{"role": "user", "content": [TextPart("and here?"), image]}]}]
    datum = _datum()
    datum.images = [VisionInput("0" * 64, np.zeros((3, 8, 8), np.float32), [], 4)]
    return {
        "/v1/call/rollout#images": RolloutRequest(POLICY, tasks, 1, SamplingParams(max_tokens=2), EpisodeLimits(), 0),
        "/v1/call/forward#images": ForwardRequest(POLICY, [datum]),
        "/v1/call/update#images": UpdateRequest(POLICY, [datum], LossConfig()),
    }


def schema_requests(target) -> st.SearchStrategy:
    """One request to a msgpack route with one field, entry or element replaced by a value drawn from its type."""
    from fuzz_cases import HttpRequest, _encode

    from tinkerless.wire.http import MSGPACK

    templates = routes(target)
    cases = [(path, where, hint) for path, template in templates.items() for where, hint in field_paths(template)]

    @st.composite
    def one(draw):
        path, where, hint = draw(st.sampled_from(cases))
        body = replaced(templates[path], where, draw(hostile_for(hint)))
        return HttpRequest("POST", path, _encode(body), {"Content-Type": MSGPACK})

    return one()
