"""msgpack codec shared by every backend (local, HTTP, Modal, SkyPilot).

Arrays travel as a msgpack extension: a small header (dtype, shape) followed by
the raw buffer, so a batch of token arrays costs one memcpy each way. Torch
tensors are sent as arrays. Dataclasses travel as maps tagged with their
import path; only classes defined inside `tinkerless` are ever rebuilt, so a
payload cannot make the receiver import arbitrary code. User code travels as
cloudpickle bytes only inside `CodeBlob` fields (see `tinkerless.wire.code`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import sys
from typing import Any

import msgpack
import numpy as np

from tinkerless.errors import ProtocolError

PROTOCOL_VERSION = 1
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

_EXT_NDARRAY = 1
_TYPE_TAG = "__dc__"
_ALLOWED_PREFIX = "tinkerless."


def _default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        fields[_TYPE_TAG] = f"{type(obj).__module__}:{type(obj).__qualname__}"
        return fields
    if isinstance(obj, np.ndarray):
        return _pack_array(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, np.generic):
        return obj.item()
    if type(obj).__module__ == "torch" and type(obj).__name__ == "Tensor":
        tensor = obj.detach().cpu()
        if not tensor.dtype.is_floating_point or tensor.dtype.itemsize >= 4 or str(tensor.dtype) == "torch.float16":
            return _pack_array(tensor.numpy())
        return _pack_array(tensor.float().numpy())  # bfloat16/fp8 have no numpy dtype: widen to float32
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise ProtocolError(
        f"cannot encode a {type(obj).__name__} on the wire",
        hint="send plain data (dict, list, str, numbers, bytes, numpy arrays, tinkerless dataclasses)",
    )


def _pack_array(array: np.ndarray) -> msgpack.ExtType:
    if not array.flags.c_contiguous:  # (ascontiguousarray would also turn 0-d into 1-d)
        array = np.ascontiguousarray(array)
    if array.dtype.hasobject:
        raise ProtocolError("object arrays cannot be sent", hint="convert to a numeric dtype first")
    header = msgpack.packb([array.dtype.str, list(array.shape)])
    return msgpack.ExtType(_EXT_NDARRAY, header + array.tobytes())


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _EXT_NDARRAY:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    offset = unpacker.tell()
    # frombuffer shares the payload's memory; copy so receivers get a writable array.
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape).copy()


def _object_hook(obj: dict) -> Any:
    tag = obj.pop(_TYPE_TAG, None)
    if tag is None:
        return obj
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
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in obj.items() if k in names})
    except TypeError as exc:
        raise ProtocolError(f"malformed {tag!r} on the wire: {exc}") from exc


def encode(obj: Any) -> bytes:
    """Encode a value (dataclasses, arrays, plain data) to msgpack bytes."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    """Decode bytes made by `encode`."""
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, object_hook=_object_hook, raw=False, strict_map_key=False
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
    if envelope["v"] != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {envelope['v']!r} is not supported (this side speaks {PROTOCOL_VERSION})",
            hint="upgrade tinkerless on the older side so client and server match",
        )
    return envelope["body"]
