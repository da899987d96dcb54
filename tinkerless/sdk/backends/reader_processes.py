"""Rollout workers in processes of their own: the local backend's readers, next to its one writer.

`LocalBackend(model, rollout_workers=N)` keeps the writer (every call that trains, saves, loads or scores:
`forward_backward`, `optim_step`, `save_state`, `forward`, ...) in this process and runs the sampling calls
(`rollout`, `rollout_multi`, `sample`) in N worker processes, each with its own copy of the model and its own
share of the CPU threads. That is Modal's topology (one update container, rollout containers) on one machine, so
rollouts overlap updates (`TrainConfig.max_staleness`) and the version hand-off runs and is tested here.

A reader holds copies of the policies it samples from. Before a call, every policy the call names is brought to
the writer's current state of it: the writer's adapter files go over with a `VersionProof` (their sha256 and the
writer's log-probs of a probe sequence), and the reader checks both before and after loading
(`functions.handoff`); a mismatch fails the call with a `WeightSyncError` naming the policy, the version and both
values, never a rollout from other weights. A state the writer was handed by `load_state` (a snapshot the async
pipeline made) is kept with its proof, so readers take it without waiting for the writer's running update.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from tinkerless.errors import RemoteError
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import BASE_POLICY, ErrorReply

READ_METHODS = ("rollout", "rollout_multi", "sample")
# Writer calls after which a policy's weights may differ from every reader's copy.
CHANGING_METHODS = ("create_policy", "reset_policy", "load_state", "optim_step", "update", "delete_policy")


def policies_of(request: Any) -> list[str]:
    """The policies a sampling request reads (frozen and trained seats alike; not the bare base model)."""
    names = [request.policy] if hasattr(request, "policy") else [s.policy for s in request.seats.values()]
    return [n for n in dict.fromkeys(names) if n not in (None, BASE_POLICY)]


def changed_policy(request: Any) -> str | None:
    """The policy a writer call changes."""
    state = getattr(request, "state", None)
    return state.policy if state is not None else getattr(request, "policy", None)


@dataclass
class Published:
    """One state of a policy as readers take it: its adapter files and the writer's proof."""
    version: int
    files: dict[str, bytes]
    proof: bytes


def publish(worker: Any, policy: str, version: int, files: dict[str, bytes]) -> Published:
    """`version` of `policy` as readers take it: the state's adapter files and the writer's proof of them (computed
    on the writer `worker`, which holds that version now)."""
    from tinkerless.functions.handoff import adapter_files, make_proof

    adapter = adapter_files(files)
    return Published(version, adapter, make_proof(worker, policy, version, adapter).to_bytes())


@dataclass
class ReaderProcess:
    """One worker process and what it holds: per policy, the writer's change count it was synced to."""
    process: Any
    connection: Any
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[str, int] = field(default_factory=dict)
    doomed: set[str] = field(default_factory=set)  # deleted on the writer: freed before this reader's next call

    def request(self, message: tuple) -> bytes:
        try:
            self.connection.send(message)
            return self.connection.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise RemoteError(f"rollout worker process {self.process.pid} died ({type(exc).__name__}); "
                              f"exit code {self.process.poll()}",
                              hint="see its output above; the run can resume from its last checkpoint") from None


def start_readers(model: str, count: int, options: dict) -> list[ReaderProcess]:
    """`count` worker processes, each building a `Worker(model, **options)`. Each is a fresh interpreter running
    this module (not multiprocessing's spawn, which re-runs the caller's script: a user's `train(...)` at the top
    of a file without a main guard would start again in every reader), talking over a socket pair."""
    readers = []
    for _ in range(count):
        mine, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-c", f"from {__name__} import serve_main; serve_main()", str(theirs.fileno()),
             json.dumps({"model": model, "options": options})],
            pass_fds=[theirs.fileno()])
        theirs.close()
        readers.append(ReaderProcess(process, Connection(mine.detach())))
    for reader in readers:  # each says it is ready (the model loaded) or why not
        try:
            reply = decode_message(reader.connection.recv())
        except (EOFError, OSError):
            reply = ErrorReply(error=f"it exited with code {reader.process.wait()}", category="server",
                               type="RemoteError", hint="see its output above")
        if isinstance(reply, ErrorReply):
            stop_readers(readers)
            raise RemoteError(f"a rollout worker process could not start: {reply.error}", hint=reply.hint)
    return readers


def stop_readers(readers: list[ReaderProcess]) -> None:
    for reader in readers:
        try:
            reader.connection.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
    for reader in readers:
        try:
            reader.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            reader.process.kill()
            reader.process.wait()
        reader.connection.close()


def _serve(connection, model: str, options: dict) -> None:
    """A reader process: a Worker answering calls and version syncs until told to stop."""
    from tinkerless.functions.handoff import VersionProof, check_files, check_loaded
    from tinkerless.functions.worker import Worker
    from tinkerless.wire.replies import error_reply
    from tinkerless.wire.messages import DeletePolicyRequest, LoadStateRequest, PolicyState

    try:
        worker = Worker(model, **options)
    except Exception as exc:  # noqa: BLE001 - the parent raises it
        connection.send(encode_message(error_reply(exc)))
        return
    connection.send(encode_message({"ready": True}))
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "stop":
            return
        if kind == "call":
            connection.send(worker.handle(message[1], message[2]))
            continue
        try:  # ("sync", policy, version, files, proof) | ("drop", policy)
            if kind == "drop":
                worker.handle("delete_policy", encode_message(DeletePolicyRequest(message[1])))
                connection.send(encode_message({"dropped": message[1]}))
                continue
            _, policy, version, files, proof_bytes = message
            proof = VersionProof.from_bytes(proof_bytes)
            check_files(proof, policy, version, files)
            worker.load_state(LoadStateRequest(PolicyState(policy, files, version), include_optimizer=False))
            gap = check_loaded(worker, proof)
            connection.send(encode_message({"policy": policy, "version": version, "probe_gap": gap}))
        except Exception as exc:  # noqa: BLE001 - the caller raises it, typed
            connection.send(encode_message(error_reply(exc)))


def serve_main() -> None:
    """The reader process's entry point: argv is the socket's descriptor and the settings as JSON."""
    settings = json.loads(sys.argv[2])
    _serve(Connection(int(sys.argv[1])), settings["model"], settings["options"])
