"""`ServedModelBackend`: one of a `tinkerless serve` server's extra base models (`--also-model`) as a backend.

A run's teacher of another base runs there (docs/distillation.md): its `forward` calls go to the server's
`/v1/call/forward` with the `X-Tinkerless-Model` header, on the same connection, call stream and sequence numbers
as the run's own calls (so the server orders them with the run's, and charges them to the run's budget as to the
key's), and their seconds go to a meter of their own (the run's `teacher` line).

The client gets each model's tokenizer from the server (`GET /v1/served-models/tokenizer`), not from a model
hub: the files the server loaded are the ones that tokenize what the teacher scores, so a client aligns with
exactly them, with no download (a laptop may have no hub access, and a directory the server was started with
exists only there) and no version skew between two copies.
"""

from __future__ import annotations

from typing import Any

from tinkerless.errors import RemoteError
from tinkerless.sdk.run.accounting import UsageMeter
from tinkerless.wire import decode_message
from tinkerless.wire.http import MSGPACK
from tinkerless.wire.messages import ErrorReply
from tinkerless.wire.replies import raise_error_reply


class ServedModelBackend:
    """The server's model `model` behind `http` (an `HTTPBackend`), with its tokenizer; refused at once, naming
    the server's models, when the server does not hold it."""

    name = "http"

    def __init__(self, http: Any, model: str):
        self.http = http
        # The server resolves the name (an alias of a model it holds is that model); one it does not hold is
        # refused here, naming the models it does hold.
        served_models(http, model)
        self.teacher_tokenizer = fetch_tokenizer(http, model)
        self.model = model
        self.usage = UsageMeter(source=http.usage.source, device=http.usage.device)

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        return self.http.post(f"/v1/call/{method}", payload, label=method, model=self.model, usage=self.usage)

    def close(self) -> None:
        """Nothing of its own to close: the connection is the run's backend's."""


def served_models(http: Any, model: str | None = None) -> dict:
    """{"main": id, "models": [{"id", "main", "vocab_size", "methods"}]}: what the server holds; with `model`, the
    error naming them when it does not hold that one."""
    response = http.get("/v1/served-models", params=None if model is None else {"model": model})
    if response.status_code == 200:
        return response.json()
    _raise(response, f"GET {http.base_url}/v1/served-models")


def fetch_tokenizer(http: Any, model: str) -> Any:
    """The tokenizer the server loaded for `model`, rebuilt here from its files."""
    from tinkerless.functions.companions.tokenizer_files import tokenizer_from_files

    response = http.get("/v1/served-models/tokenizer", params={"model": model})
    what = f"the tokenizer of {model[:200]!r} from {http.base_url}"
    if response.status_code != 200:
        _raise(response, what)
    reply = decode_message(response.content)
    return tokenizer_from_files(reply.get("files") if isinstance(reply, dict) else None, source=what)


def _raise(response: Any, what: str) -> None:
    if response.headers.get("content-type", "").startswith(MSGPACK):
        reply = decode_message(response.content)
        if isinstance(reply, ErrorReply):
            raise_error_reply(reply, where=what)
    raise RemoteError(f"{what}: HTTP {response.status_code} {response.text[:200]!r}",
                      hint="the server may be older than this client (no extra models): upgrade it")
