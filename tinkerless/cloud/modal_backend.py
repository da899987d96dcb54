"""`ModalBackend`: the functions run in Modal containers, called with the same bytes as every backend.

Each call goes to the class that serves it (`role_for`): generation to
`Rollout`, log-probs to `Forward`, everything that changes or reads a policy's
training state to the single `Update` container. The backend remembers the version
of every policy from the writer's replies and names them in every call, so readers
load exactly the adapter the last update committed (see `modal_app`).

Fan-out: a rollout with more than `tasks_per_container` tasks is split into chunks of
that many tasks, run with `.map` across containers, and merged in order (task
indices shifted back). Chunk i is the same request with `tasks[i*n:(i+1)*n]` and
seed `chunk_seed(seed, i)`; chunk 0 keeps the request's seed, so a request that
fits one container is sent unchanged. The merged result is therefore exactly the
concatenation of those chunk requests run anywhere (deterministic for a given
`tasks_per_container`, independent of how many containers run them), but not the
same samples as the unsplit request: batched sampling draws from one random stream
per request, and a different batch draws differently.

A teacher of another base model (`served_model`) is the `Forward` class parameterized with the teacher's model:
containers of their own, loaded with it, answering `forward` on its base weights, metered apart (the run's
`teacher` line); both models' tokenizers come from their containers (`tokenizer_files`).

Pay-per-use: every container call returns the seconds it ran; `self.usage` records
them per function as GPU-seconds (seconds x GPUs per container, what Modal bills), one
record per container call, so a fanned-out rollout counts each chunk. The meter's
device is "Modal <GPU>" when every GPU class uses the same type, which the price
table matches; with mixed types no single price applies.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

from tinkerless.cloud.modal_config import GPU_ROLES, ModalConfig
from tinkerless.cloud.modal_volume import VOLUME_MOUNT
from tinkerless.errors import ConfigError, RemoteError
from tinkerless.sdk.run.accounting import UsageMeter
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply, MultiAgentRolloutRequest, RolloutRequest, RolloutResult

_READER_ROLES = {"rollout": "rollout", "rollout_multi": "rollout", "sample": "rollout", "forward": "forward"}
_FAN_OUT = ("rollout", "rollout_multi")
_TOKEN_HINT = (
    "run `modal token new` (it opens a browser and saves a token to ~/.modal.toml), or set "
    "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET; then run again"
)


def role_for(method: str) -> str:
    """Which class serves a function: readers for generation and log-probs, the writer for everything else."""
    return _READER_ROLES.get(method, "update")


def role_options(role: str, spec: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """One role's Worker options: a class with several GPUs runs the update and forward functions as that many
    ranks (`functions/sharding`), and samples with vLLM's tensor parallelism over them."""
    count = spec.gpu_count if spec.gpu else 1
    if count == 1:
        return dict(options)
    return {**options, ("tensor_parallel_size" if role == "rollout" else "ranks"): count}


def chunk_seed(seed: int, index: int) -> int:
    """Seed of fan-out chunk `index`; chunk 0 keeps the request's own seed."""
    return (seed + index * 1_000_033) % (2**31 - 1)


def split_rollout(request: Any, tasks_per_container: int) -> list[tuple[int, Any]]:
    """(task offset, chunk request) pairs; one pair holding the request itself when it fits."""
    tasks = request.tasks
    if len(tasks) <= tasks_per_container:
        return [(0, request)]
    return [
        (start, dataclasses.replace(request, tasks=tasks[start : start + tasks_per_container], seed=chunk_seed(request.seed, i)))
        for i, start in enumerate(range(0, len(tasks), tasks_per_container))
    ]


def merge_rollout_replies(replies: list[bytes], offsets: list[int]) -> bytes:
    """One reply from the chunks' replies, in chunk order; the first error wins."""
    results = [decode_message(r) for r in replies]
    for reply, result in zip(replies, results):
        if isinstance(result, ErrorReply):
            return reply
    episodes, stats = [], {}
    for offset, result in zip(offsets, results):
        for episode in result.episodes:
            episode.task_index += offset
            episodes.append(episode)
        for key, value in result.stats.items():
            # Chunks run side by side: wall time is the slowest chunk's, counts add up.
            stats[key] = max(stats.get(key, 0.0), value) if key == "seconds" else stats.get(key, 0.0) + value
    return encode_message(RolloutResult(episodes, stats))


class ModalBackend:
    """Calls the Modal classes. `classes` maps role -> a modal.Cls (or anything with the same call surface)."""

    name = "modal"

    def __init__(
        self,
        model: str,
        classes: Mapping[str, Any],
        config: ModalConfig,
        *,
        state_dir: str = VOLUME_MOUNT,
        volume: str | None = None,
        on_close: Callable[[], None] | None = None,
        **worker_options: Any,
    ):
        self.model = model
        self.config = config
        specs = {role: getattr(config, role) for role in GPU_ROLES}
        types = {spec.gpu for spec in specs.values()}
        # Priced per GPU-hour, so a container with n GPUs records n GPU-seconds per second.
        self._gpus_per_container = {role: spec.gpu_count if spec.gpu else 1 for role, spec in specs.items()}
        self.usage = UsageMeter(
            source="Modal containers (GPU-seconds: each call's container seconds x its GPUs)",
            device=f"Modal {types.pop()}" if len(types) == 1 and None not in types else None,  # mixed GPUs: no one price
        )
        params = {
            "model": model,
            "volume": config.volume_name if volume is None else volume,
            "state_dir": state_dir,
            "keep_versions": config.keep_versions,
        }
        self._objects = {
            role: classes[role](**params, options=json.dumps(role_options(role, specs[role], worker_options), sort_keys=True))
            for role in GPU_ROLES
        }
        self._classes, self._params, self._worker_options = classes, params, worker_options
        self._versions: dict[str, int] = {}
        self._lock = threading.Lock()
        self._on_close = on_close

    @property
    def versions(self) -> dict[str, int]:
        """The committed version of every policy this backend has seen."""
        with self._lock:
            return dict(self._versions)

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        role = role_for(method)
        if method in _FAN_OUT:
            request = decode_message(payload)
            if isinstance(request, (RolloutRequest, MultiAgentRolloutRequest)):
                chunks = split_rollout(request, self.config.tasks_per_container)
                if len(chunks) > 1:
                    return self._fan_out(role, method, chunks)
        reply, seconds = self._remote(role, method, payload)
        self._record(role, method, seconds)
        if role == "update":
            self._track(method, payload, reply)
        return reply

    def tokenizer(self) -> Any:
        """The policy's tokenizer, as the model's `Forward` container loaded it."""
        return _tokenizer_of(self._objects["forward"], f"modal forward ({self.model})")

    def served_model(self, model: str) -> "ModalTeacher":
        """Another base model (a teacher) in a `Forward` class of its own: a backend answering `forward`."""
        options = role_options("forward", self.config.forward, self._worker_options)
        forward = self._classes["forward"](**{**self._params, "model": model}, options=json.dumps(options, sort_keys=True))
        return ModalTeacher(model, forward, self.usage.source, self.usage.device, self._gpus_per_container["forward"])

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    # ---- calls ------------------------------------------------------------------
    def _record(self, role: str, method: str, seconds: float) -> None:
        self.usage.record(method, seconds * self._gpus_per_container[role])

    def _remote(self, role: str, method: str, payload: bytes) -> tuple[bytes, float]:
        with _modal_errors(f"{role}.{method}"):
            reply, seconds = self._objects[role].call.remote(method, payload, self.versions)
        return reply, seconds

    def _fan_out(self, role: str, method: str, chunks: list[tuple[int, Any]]) -> bytes:
        payloads = [encode_message(chunk) for _, chunk in chunks]
        versions = self.versions  # one snapshot: every chunk samples from the same adapters
        n = len(payloads)
        with _modal_errors(f"{role}.{method} (fan-out over {n} containers)"):
            results = list(self._objects[role].call.map([method] * n, payloads, [versions] * n))
        for _, seconds in results:
            self._record(role, method, seconds)
        return merge_rollout_replies([reply for reply, _ in results], [offset for offset, _ in chunks])

    def _track(self, method: str, payload: bytes, reply: bytes) -> None:
        """Learn the version the writer committed from its reply."""
        result = decode_message(reply)
        if isinstance(result, ErrorReply):
            return
        if method == "create_policy":
            name = result["policy"]
            # An existing policy (a warm writer that already had it) keeps its version: ask the writer.
            version = 0 if result["created"] else self._writer_versions()[name]
        elif method in ("update", "optim_step"):
            name, version = decode_message(payload).policy, result.policy_version
        elif method == "load_state":
            name, version = result["policy"], result["policy_version"]
        else:
            return
        with self._lock:
            self._versions[name] = version

    def _writer_versions(self) -> dict[str, int]:
        reply, seconds = self._remote("update", "info", encode_message({}))
        self._record("update", "info", seconds)
        info = decode_message(reply)
        if isinstance(info, ErrorReply):
            raise RemoteError(f"modal update.info failed: {info.error}", remote_type=info.type, traceback=info.traceback)
        return info["policies"]


class ModalTeacher:
    """A backend on the `Forward` class holding another base model: `forward` on its base weights, metered apart."""

    name = "modal"

    def __init__(self, model: str, forward: Any, source: str, device: str | None, gpus: int):
        self.model, self._forward, self._gpus = model, forward, gpus
        self.usage = UsageMeter(source=source, device=device)

    def call_bytes(self, method: str, payload: bytes) -> bytes:
        if method != "forward":  # the Forward class serves nothing else
            return encode_message(ErrorReply(f"the teacher {self.model!r} on Modal answers forward only, not {method!r}",
                                             "user", "UserError"))
        with _modal_errors(f"forward.{method} ({self.model})"):
            reply, seconds = self._forward.call.remote(method, payload, {})  # base weights: no policy versions
        self.usage.record(method, seconds * self._gpus)
        return reply

    def tokenizer(self) -> Any:
        return _tokenizer_of(self._forward, f"modal forward ({self.model})")

    def close(self) -> None:
        """Its containers are the App's: they stop with it."""


def _tokenizer_of(forward: Any, where: str) -> Any:
    from tinkerless.functions.companions.tokenizer_files import tokenizer_from_files

    with _modal_errors(f"{where}.tokenizer_files"):
        files = forward.tokenizer_files.remote()
    return tokenizer_from_files(files, source=where)


@contextlib.contextmanager
def _modal_errors(where: str):
    """Modal's own failures (auth, lost containers, timeouts) as tinkerless errors that say what to do."""
    try:
        yield
    except Exception as exc:
        try:
            from modal.exception import AuthError
            from modal.exception import Error as ModalError
        except ImportError:  # pragma: no cover - a backend without modal has no modal errors
            raise exc from None
        if isinstance(exc, AuthError):
            raise ConfigError(f"Modal has no valid credentials: {exc}", hint=_TOKEN_HINT) from exc
        if isinstance(exc, ModalError):
            raise RemoteError(
                f"modal {where} failed: {type(exc).__name__}: {exc}",
                hint="see the container logs with `modal app logs <app id>`; raise the timeout or memory in ModalConfig if it ran out",
            ) from exc
        raise


def make_modal_backend(model: str, *, config: ModalConfig | None = None, **worker_options: Any) -> ModalBackend:
    """Start the App as an ephemeral Modal app and return a backend on it (closed by `close()`).

    `config` defaults to `ModalConfig.from_env()`; `worker_options` (engine, micro_batch_size,
    max_batch_size) go to every container's Worker.
    """
    try:
        import modal
    except ImportError as exc:
        raise ConfigError("backend 'modal' needs the modal package", hint='pip install "tinkerless[modal]"') from exc
    from tinkerless.cloud.modal_app import build_app

    config = config if config is not None else ModalConfig.from_env()
    from tinkerless.cloud.preflight import check_modal

    check_modal(model, config, engine=worker_options.get("engine", "auto"), dtype=worker_options.get("dtype", "auto"))
    built = build_app(config)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(modal.enable_output())  # image builds and container starts show their progress
        with _modal_errors("app start"):
            stack.enter_context(built.app.run())
    except BaseException:
        stack.close()
        raise
    backend = ModalBackend(model, built.classes, config, on_close=stack.close, **worker_options)
    atexit.register(backend.close)  # a run that raised never reaches close(): stop the App on exit anyway
    return backend


__all__ = ["ModalBackend", "ModalTeacher", "chunk_seed", "role_options", "make_modal_backend", "merge_rollout_replies", "role_for", "split_rollout"]
