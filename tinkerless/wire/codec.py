"""msgpack codec shared by every backend (local, HTTP, Modal, SkyPilot).

A message is a small frame: a 12-byte prefix, a msgpack body, then the raw bytes
of every array in it. In the body an array is an extension holding only its
dtype, shape and offset; its data follows out of band, so encoding copies each
array once (into the frame) and decoding copies the whole array section once,
into memory the receiver owns, of which each array is a writable view (so an
array kept alive keeps its message's arrays alive too). Plain msgpack (no frame,
arrays inline) is still decoded. Torch tensors are sent as arrays. Dataclasses travel as maps tagged with their
import path; only classes defined inside `tinkerless` are ever rebuilt, so a
payload cannot make the receiver import arbitrary code. User code travels as
cloudpickle bytes only inside `CodeBlob` fields (see `tinkerless.wire.code`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import struct
import sys
from typing import Any

import msgpack
import numpy as np

from tinkerless.errors import ProtocolError

PROTOCOL_VERSION = 1
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

_EXT_NDARRAY = 1  # inline: header + data (plain msgpack)
_EXT_NDARRAY_OOB = 2  # out of band: header + offset into the frame's buffer section
_FRAME_MAGIC = b"\x00TLW"  # no msgpack envelope starts with 0x00
_FRAME_PREFIX = struct.Struct("<4sII")  # magic, body length, buffer section length
_OFFSET = struct.Struct("<Q")  # an out-of-band array's start in the buffer section
_TYPE_TAG = "__dc__"
_ALLOWED_PREFIX = "tinkerless."


_FIELDS: dict[type, tuple[str, tuple[str, ...]]] = {}  # dataclass -> (wire tag, field names)


def _dataclass_fields(cls: type) -> tuple[str, tuple[str, ...]]:
    cached = _FIELDS.get(cls)
    if cached is None:
        cached = _FIELDS[cls] = (f"{cls.__module__}:{cls.__qualname__}", tuple(f.name for f in dataclasses.fields(cls)))
    return cached


class _Frame:
    """The out-of-band arrays of one message, and where each one's bytes will start."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.size = 0

    def add(self, array: np.ndarray) -> msgpack.ExtType:
        ext = msgpack.ExtType(_EXT_NDARRAY_OOB, _OFFSET.pack(self.size) + _array_header(array))
        self.arrays.append(array)
        self.size += array.nbytes
        return ext


def _default(obj: Any, frame: _Frame | None = None) -> Any:
    if isinstance(obj, np.ndarray):  # the common case first: batches are mostly arrays
        return _pack_array(obj, frame)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        tag, names = _dataclass_fields(type(obj))
        fields = {name: getattr(obj, name) for name in names}
        fields[_TYPE_TAG] = tag
        return fields
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        tensor = obj.detach().cpu()
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize >= 4 or str(tensor.dtype) == "torch.float16":
            return _pack_array(tensor.numpy(), frame)
        return _pack_array(tensor.float().numpy(), frame)  # bfloat16/fp8 have no numpy dtype: widen to float32
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise ProtocolError(
        f"cannot encode a {type(obj).__name__} on the wire",
        hint="send plain data (dict, list, str, numbers, bytes, numpy arrays, tinkerless dataclasses)",
    )


def _pack_array(array: np.ndarray, frame: _Frame | None) -> msgpack.ExtType:
    if not array.flags.c_contiguous:  # (ascontiguousarray would also turn 0-d into 1-d)
        array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ProtocolError("object arrays cannot be sent", hint="convert to a numeric dtype first")
    if frame is None:  # plain msgpack: the data inline
        return msgpack.ExtType(_EXT_NDARRAY, msgpack.packb([array.dtype.str, list(array.shape)]) + array.tobytes())
    return frame.add(array)


_HEADERS: dict[tuple[str, int], tuple[bytes, struct.Struct]] = {}  # (dtype, ndim) -> (fixed part, shape format)


def _array_header(array: np.ndarray) -> bytes:
    key = (array.dtype.str, array.ndim)
    cached = _HEADERS.get(key)
    if cached is None:
        dtype = array.dtype.str.encode()
        cached = _HEADERS[key] = (struct.pack("<B", len(dtype)) + dtype + struct.pack("<B", array.ndim), struct.Struct(f"<{array.ndim}q"))
    fixed, shape = cached
    return fixed + shape.pack(*array.shape)


_PARSED: dict[bytes, tuple[np.dtype, struct.Struct]] = {}  # header's dtype+ndim bytes -> parsed


def _read_array(data: bytes, buffers: memoryview | None) -> np.ndarray:
    """An out-of-band array: a view into the frame's (already copied, writable) array section."""
    if buffers is None:
        raise ProtocolError("an out-of-band array arrived outside a frame")
    try:
        (offset,) = _OFFSET.unpack_from(data, 0)
        dtype_len = data[8]
        key = bytes(data[9 : 10 + dtype_len])  # dtype and ndim
        parsed = _PARSED.get(key)
        if parsed is None:
            dtype = np.dtype(key[:-1].decode())
            if dtype.hasobject:
                raise ValueError("object arrays are not accepted")
            parsed = _PARSED[key] = (dtype, struct.Struct(f"<{key[-1]}q"))
        dtype, shape_format = parsed
        shape = shape_format.unpack_from(data, 10 + dtype_len)
    except (struct.error, TypeError, ValueError, IndexError) as exc:
        raise ProtocolError(f"malformed array header on the wire ({exc})") from exc
    count = shape[0] if len(shape) == 1 else math.prod(shape)
    if count < 0 or offset + count * dtype.itemsize > len(buffers):
        raise ProtocolError("malformed array on the wire: its data lies outside the message")
    array = np.frombuffer(buffers, dtype=dtype, count=count, offset=offset)
    return array if len(shape) == 1 else array.reshape(shape)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY_OOB:
        raise ProtocolError("an out-of-band array arrived outside a frame")
    if code != _EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    offset = unpacker.tell()
    # frombuffer shares the payload's memory; copy so receivers get a writable array.
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape).copy()


_CLASSES: dict[str, tuple[type, frozenset[str]]] = {}  # wire tag -> (class, field names), once checked


def _object_hook(obj: dict) -> Any:
    tag = obj.pop(_TYPE_TAG, None)
    if tag is None:
        return obj
    cached = _CLASSES.get(tag)
    if cached is None:
        cached = _CLASSES[tag] = _resolve(tag)
    cls, names = cached
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as exc:
        raise ProtocolError(f"malformed {tag!r} on the wire: {exc}") from exc


def _resolve(tag: str) -> tuple[type, frozenset[str]]:
    """The tinkerless dataclass a wire tag names; anything else is refused."""
    module_name, _, qualname = tag.partition(":")
    if not (module_name + ".").startswith(_ALLOWED_PREFIX):
        raise ProtocolError(f"refusing to rebuild non-tinkerless type {tag!r} from the wire")
    try:
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as exc:
        raise ProtocolError(
            f"unknown wire type {tag!r}",
            hint="client and server run different tinkerless versions; install the same version on both",
        ) from exc
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__.startswith(_ALLOWED_PREFIX)):
        raise ProtocolError(f"refusing to rebuild {tag!r}: not a tinkerless wire type")
    return cls, frozenset(f.name for f in dataclasses.fields(cls))


def encode(obj: Any) -> bytes:
    """Encode a value (dataclasses, arrays, plain data) as a frame: prefix, msgpack body, array data."""
    frame = _Frame()

    def default(o: Any) -> Any:
        if type(o) is np.ndarray and o.flags.c_contiguous and not o.dtype.hasobject:  # the hot path
            return frame.add(o)
        return _default(o, frame)

    body = msgpack.packb(obj, default=default, use_bin_type=True)
    prefix = _FRAME_PREFIX.pack(_FRAME_MAGIC, len(body), frame.size)
    # One copy of every array, straight from its memory into the frame.
    arrays = (memoryview(a).cast("B") if a.ndim and a.size else a.tobytes() for a in frame.arrays)
    return b"".join([prefix, body, *arrays])


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode` (or plain msgpack)."""
    view = memoryview(data)
    buffers = None
    if data[:4] == _FRAME_MAGIC:
        if len(data) < _FRAME_PREFIX.size:
            raise ProtocolError("malformed message: truncated frame")
        _, body_len, size = _FRAME_PREFIX.unpack_from(data, 0)
        start = _FRAME_PREFIX.size + body_len
        if start + size != len(data):
            raise ProtocolError(
                f"malformed message: the frame declares {start + size} bytes but {len(data)} arrived",
                hint="the message was cut off or has trailing data; resend it",
            )
        # One copy of the whole array section into memory the receiver owns: every array is then a
        # writable view of it (disjoint ranges), with no allocation or copy per array.
        buffers = memoryview(bytearray(view[start:]))
        view = view[_FRAME_PREFIX.size : start]
    def ext_hook(code: int, ext: bytes) -> Any:
        return _read_array(ext, buffers) if code == _EXT_NDARRAY_OOB else _ext_hook(code, ext)

    return msgpack.unpackb(
        view,
        ext_hook=ext_hook,
        object_hook=_object_hook,
        raw=False,
        strict_map_key=False,
    )


def encode_message(body: Any) -> bytes:
    """Encode a request or reply with the protocol envelope."""
    return encode({"v": PROTOCOL_VERSION, "py": PYTHON_VERSION, "body": body})


def decode_message(data: bytes) -> Any:
    """Decode an envelope, checking the protocol version first."""
    try:
        envelope = decode(data)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"malformed message: {exc}") from exc
    if not isinstance(envelope, dict) or "v" not in envelope:
        raise ProtocolError("malformed message: no protocol envelope")
    if "body" not in envelope:
        raise ProtocolError("malformed message: the envelope has no body", hint="send encode_message(request)")
    if envelope["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {repr(envelope['v'])[:32]} is not supported (this side speaks {PROTOCOL_VERSION})",
            hint="upgrade tinkerless on the older side so client and server match",
        )
    return envelope["body"]
