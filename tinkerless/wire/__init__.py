"""The wire: wire types (dataclasses) and the msgpack/cloudpickle codec every backend uses.

- `encode_message` / `decode_message`: versioned msgpack envelopes with compact arrays.
- `pack_code` / `unpack_code`: user code by value (cloudpickle) in `CodeBlob` fields.
- `messages`: the requests and replies of the rollout, forward and update functions;
- `content`: content parts (text and images) of messages, tasks and observations, checked under the image limits,
  and the processed images a datum carries;
- `runs`: coordinator calls and checkpoints of a run hosted by a server;
- `validate` / `run_calls` / `tasks`: every value a client sends, checked at the boundary (`tasks`: a single-turn
  rollout's messages and images; `value_rules`: the rules for one field they share);
- `http`: the HTTP transport's header names and its size-limited body reader;
- `replies`: an `ErrorReply` raised back as the error it reports.
"""

from tinkerless.wire.code import CodeBlob, pack_code, unpack_code
from tinkerless.wire.codec import PROTOCOL_VERSION, PYTHON_VERSION, decode, decode_message, encode, encode_message

__all__ = [
    "PROTOCOL_VERSION",
    "PYTHON_VERSION",
    "CodeBlob",
    "decode",
    "decode_message",
    "encode",
    "encode_message",
    "pack_code",
    "unpack_code",
]
