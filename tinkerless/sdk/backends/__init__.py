"""Where the functions run, and the client objects that call them.

- `base`: the `Backend` protocol, `call()`, `LocalBackend` (in-process, through the wire codec) and
  `make_backend`, which finds a backend by name (`local`, `http://...`, and the cloud ones registered by
  name in `CLOUD_BACKENDS`, imported only when named: the client never imports `tinkerless.cloud` otherwise);
- `http`: `HTTPBackend`, on a `tinkerless serve` server; `client`: `TrainingClient`, Tinker-style primitives;
- `run_host` / `server_runs`: where a run's coordinator and checkpoints live (storage, or the server).
"""

from tinkerless.sdk.backends.base import (
    Backend, ClientTimed, LocalBackend, call, device_of, make_backend, raise_error_reply, with_usage,
)

__all__ = ["Backend", "ClientTimed", "LocalBackend", "call", "device_of", "make_backend", "raise_error_reply",
           "with_usage"]
