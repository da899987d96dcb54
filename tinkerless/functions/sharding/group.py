"""`ShardedWorker`: a group of N rank processes behind the `Worker`'s call surface (rank 0 answers).

A backend calls it as it calls a `Worker` (`handle(method, bytes)`, or the typed methods): each request goes
whole to every rank (`process.py`), the ranks run it together over FSDP2 (`rank.py`), and rank 0's reply comes
back. A client cannot tell one rank from eight except by speed.

This process holds no model and is the ranks' watchdog: it waits on their pipes and on their process handles
together, so a rank that dies mid-call (a crash, the OOM killer) fails that call at once with a `RankFailed`
naming the rank, instead of leaving the others blocked in a collective; a rank that fails alone (its peers
still running after `grace_s`) does the same. The group is then ended and starts again on the next call, each
policy back at its last saved state (the last `save_state` that included the optimizer: on Modal every update
is saved before it is answered, so that is the last committed version); a policy never saved is gone, and
calls on it say so.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable

from tinkerless.errors import ConfigError, RankFailed, UserError
from tinkerless.functions.precision import check_dtype, dtype_name, resolve_dtype
from tinkerless.functions.sharding.process import rank_main
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.replies import error_reply, raise_error_reply
from tinkerless.wire.messages import (
    ErrorReply,
    LoadStateRequest,
    PolicyState,
)

SAMPLING = ("rollout", "rollout_multi", "sample")
SAMPLER_OPTIONS = ("engine", "max_batch_size", "tensor_parallel_size", "user_code_hosts")
MAX_RANKS = 64


@dataclass
class PolicyVersion:
    """What callers read of a policy here (`worker.policies[name].version`): the ranks hold the rest."""

    version: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ShardedWorker:
    """The update (and forward) functions over `world_size` ranks; see the module docstring."""

    MODEL_FREE_METHODS = ("info",)

    def __init__(
        self,
        model: str,
        *,
        world_size: int,
        device: str | None = None,
        dtype: str = "auto",
        threads: int | None = None,
        rank_hook: Callable[[Any], None] | None = None,
        timeout_s: float = 1800.0,
        grace_s: float = 30.0,
        start_timeout_s: float = 1800.0,
        **worker_options: Any,
    ):
        """`device`: "cuda" (one GPU per rank; the default when there are enough) or "cpu" (gloo, for tests and
        benchmarks). `rank_hook(worker)` runs in each rank once its RankWorker is built (tests inject faults with
        it; it must pickle). `timeout_s` bounds one call and each collective; `grace_s` how long the other ranks
        may go on after one failed alone. Other options go to each rank's Worker (micro_batch_size, ...)."""
        import torch

        from tinkerless.functions.threads import choose_threads
        from tinkerless.functions.worker import Worker

        if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= MAX_RANKS:
            raise ConfigError(f"world_size={world_size!r} is not a number of ranks from 1 to {MAX_RANKS}")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # A machine with GPUs trains on them: too few is an error, never a silent fall back to CPU ranks.
        device = device or ("cuda" if gpus else "cpu")
        if device not in ("cuda", "cpu"):
            raise ConfigError(f"device={device!r}: a sharded update runs on 'cuda' or 'cpu'")
        if device == "cuda" and gpus < world_size:
            raise ConfigError(f"{world_size} ranks need {world_size} GPUs; this machine has {gpus}",
                              hint="ask for as many GPUs as ranks (ModalConfig gpu='H100:4', accelerators: H100:4)")
        self.METHODS = Worker.METHODS
        self.model_name, self.world_size, self.device = model, world_size, device
        name = check_dtype(dtype)
        self.dtype = resolve_dtype(name, device)  # the base weights' dtype, as one Worker on this device would pick
        share = max(1, choose_threads(threads).threads // world_size) if device == "cpu" else threads
        # The ranks do not sample: the sampler's options (a role's shared ones, on Modal) have nothing to set there.
        training = {k: v for k, v in worker_options.items() if k not in SAMPLER_OPTIONS}
        self._options = {**training, "dtype": dtype_name(self.dtype), "threads": share}
        self._hook, self._timeout, self._grace, self._start_timeout = rank_hook, timeout_s, grace_s, start_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._versions: dict[str, int] = {}
        self._saved: dict[str, PolicyState] = {}  # each policy's last state saved with its optimizer
        self._info: dict[str, Any] = {}
        self._finalizer: Any = None
        self._start()

    # ---- what callers read -------------------------------------------------------
    @property
    def policies(self) -> dict[str, PolicyVersion]:
        return {name: PolicyVersion(version) for name, version in self._versions.items()}

    @property
    def vocab_size(self) -> int:
        return int(self._info["vocab_size"])

    @property
    def device_name(self) -> str:
        return str(self._info.get("device_name", self.device))

    def info(self, _request: Any = None) -> dict:
        """Answered here, from what the ranks last reported: it never waits for a call in flight."""
        return {**{k: v for k, v in self._info.items() if k != "vocab_size"}, "policies": dict(self._versions),
                "ranks": self.world_size, "engine": "sharded"}

    # ---- the ranks -------------------------------------------------------------------
    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked into
        port = free_port()
        device_kind = "cuda" if self.device == "cuda" else "cpu"
        for rank in range(self.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=rank_main, name=f"tinkerless-rank-{rank}", daemon=True,
                args=(rank, self.world_size, port, child, self.model_name, device_kind, self._options, self._hook,
                      self._timeout),
            )
            process.start()
            child.close()
            self._procs.append(process)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill, list(self._procs), list(self._conns))
        replies = self._collect("start", self._start_timeout)
        rank0 = decode_message(replies[0])
        self._info = {"model": self.model_name, "device": self.device, "vocab_size": rank0["vocab_size"],
                      **{k: rank0.get(k) for k in ("device_name", "dtype", "threads")}}  # fmt: skip
        # Back to where the last group left off: every saved policy at its saved version.
        for name, state in list(self._saved.items()):
            self._exchange("load_state", encode_message(LoadStateRequest(state, include_optimizer=True)))
            self._versions[name] = state.policy_version

    @property
    def running(self) -> bool:
        return bool(self._procs)

    def close(self) -> None:
        """Stop the ranks (politely, then not)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for process in self._procs:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stop()

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._procs, self._conns, self._finalizer = [], [], None

    def _exchange(self, method: str, payload: bytes) -> bytes:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, payload))
            except OSError:
                self._fail(rank, f"could not be reached (exit code {self._exit_code(rank)})", method)
        return self._collect(method, self._timeout)[0]

    def _collect(self, method: str, timeout: float) -> list[bytes]:
        """Every rank's answer to the call in flight; RankFailed as soon as one rank dies or fails alone."""
        answers: dict[int, tuple[bool, bytes]] = {}
        started, failed_at = time.monotonic(), None
        while len(answers) < self.world_size:
            waiting = {r: c for r, c in enumerate(self._conns) if r not in answers}
            sentinels = {self._procs[r].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout=1.0)
            for rank, conn in waiting.items():
                if conn in ready or conn.poll():
                    try:
                        answers[rank] = conn.recv()
                    except (EOFError, OSError):
                        pass  # the process died: its sentinel says so below
            for sentinel in ready:
                rank = sentinels.get(sentinel)  # type: ignore[call-overload]
                if rank is not None and rank not in answers:
                    self._fail(rank, f"died (exit code {self._exit_code(rank)})", method)
            errors = [r for r, (ok, _) in answers.items() if not ok]
            if errors and failed_at is None:
                failed_at = time.monotonic()
            now = time.monotonic()
            if errors and len(answers) < self.world_size and now - failed_at > self._grace:
                self._fail(errors[0], f"failed alone ({_describe(answers[errors[0]][1])})", method)
            if now - started > timeout:
                late = [r for r in range(self.world_size) if r not in answers]
                self._fail(late[0], f"did not answer within {timeout:.0f}s", method)
        if method == "start" and any(not ok for ok, _ in answers.values()):
            rank = next(r for r, (ok, _) in sorted(answers.items()) if not ok)
            text = answers[rank][1].decode() if isinstance(answers[rank][1], bytes) else str(answers[rank][1])
            self._stop()
            raise RankFailed(f"rank {rank} of {self.world_size} could not start: {text.strip().splitlines()[-1]}",
                             hint=f"its traceback:\n{text}")
        oks = {ok for ok, _ in answers.values()}
        if len(oks) > 1:  # some ranks failed and some did not: their states may differ, so the group ends
            rank = next(r for r, (ok, _) in sorted(answers.items()) if not ok)
            self._fail(rank, f"failed alone ({_describe(answers[rank][1])})", method)
        if oks == {False}:
            return [answers[0][1]]  # the same error on every rank (a refused request): rank 0's
        return [answers[r][1] for r in range(self.world_size)]

    def _exit_code(self, rank: int) -> int | None:
        self._procs[rank].join(timeout=5)  # its sentinel fired: it is gone, but may not be reaped yet
        return self._procs[rank].exitcode

    def _fail(self, rank: int, why: str, method: str) -> None:
        self._stop()
        lost = sorted(set(self._versions) - set(self._saved))
        self._versions = {name: state.policy_version for name, state in self._saved.items()}
        kept = ", ".join(f"{n!r} v{v}" for n, v in sorted(self._versions.items())) or "none"
        raise RankFailed(
            f"rank {rank} of {self.world_size} {why} during {method}: the call did not complete; the ranks restart "
            f"on the next call with policies at their last saved versions ({kept})"
            + (f"; never saved, so gone: {', '.join(map(repr, lost))}" if lost else ""),
            hint="see the rank's log above; an out-of-memory death needs more GPUs or a smaller batch "
            "(docs/scaling.md)",
        )

    # ---- calls ---------------------------------------------------------------------------
    def handle(self, method: str, payload: bytes) -> bytes:
        """One call from its encoded request; errors come back as an `ErrorReply`, as from a Worker."""
        try:
            if method not in self.METHODS:
                raise UserError(f"unknown function {method!r}", hint=f"one of {', '.join(self.METHODS)}")
            if method == "info":
                return encode_message(self.info())
            if method in SAMPLING:
                raise ConfigError(f"{method}: a sharded update does not sample",
                                  hint="send rollouts and samples to the rollout role (vLLM's tensor_parallel_size "
                                  "spreads a large model over its GPUs)")  # fmt: skip
            if not self.running:
                self._start()
            reply = self._exchange(method, payload)
            self._track(method, payload, reply)
            return reply
        except Exception as exc:  # as Worker.handle: every failure a structured reply
            return encode_message(error_reply(exc))

    def _track(self, method: str, payload: bytes, reply: bytes) -> None:
        result = decode_message(reply)
        if isinstance(result, ErrorReply):
            return
        if method == "create_policy" and result.get("created"):
            self._versions[result["policy"]] = 0
        elif method in ("update", "optim_step"):
            self._versions[decode_message(payload).policy] = result.policy_version
        elif method in ("load_state", "reset_policy"):
            self._versions[result["policy"]] = result["policy_version"]
        elif method == "delete_policy" and result.get("deleted"):
            self._versions.pop(result["policy"], None)
            self._saved.pop(result["policy"], None)
        elif method == "save_state" and "optimizer.pt" in result.files:
            if self._versions.get(result.policy) == result.policy_version:
                self._saved[result.policy] = result

    def _call(self, method: str, request: Any) -> Any:
        result = decode_message(self.handle(method, encode_message(request)))
        if isinstance(result, ErrorReply):
            raise_error_reply(result, where=f"the sharded {method}")
        return result

    def create_policy(self, request: Any) -> dict:
        return self._call("create_policy", request)

    def delete_policy(self, request: Any) -> dict:
        return self._call("delete_policy", request)

    def reset_policy(self, request: Any) -> dict:
        return self._call("reset_policy", request)

    def forward(self, request: Any) -> Any:
        return self._call("forward", request)

    def forward_backward(self, request: Any) -> Any:
        return self._call("forward_backward", request)

    def optim_step(self, request: Any) -> Any:
        return self._call("optim_step", request)

    def update(self, request: Any) -> Any:
        return self._call("update", request)

    def save_state(self, request: Any) -> PolicyState:
        return self._call("save_state", request)

    def load_state(self, request: Any) -> dict:
        return self._call("load_state", request)

def _describe(reply: bytes) -> str:
    try:
        error = decode_message(reply)
        return f"{error.type}: {error.error}"
    except Exception:  # noqa: BLE001 - a start failure's traceback text
        return str(reply)[-300:]


def _kill(processes: list[Any], conns: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join(timeout=10)
    for conn in conns:
        conn.close()
