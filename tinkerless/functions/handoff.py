"""The version hand-off between a policy's one writer (the update) and its readers (rollout, forward).

Peers have shipped silent failures where rollouts kept sampling old weights after a sync. Here the writer
publishes, with every version of a policy, a `VersionProof`: the sha256 of the adapter's files and the policy's
log-probs of a fixed probe sequence. A reader that loads that version checks both:

- before it loads: the files it read hash to the writer's digest (a torn, stale or mixed-up copy is caught);
- after it loads: its own log-probs of the probe equal the writer's within a tolerance for the dtype (what the
  hash cannot see: a load that did not take, an adapter applied to another base, another precision).

A mismatch is a `WeightSyncError` naming the policy, the version and both values; the reader serves nothing from
that version. Modal's readers (`cloud/modal_app.py`) and the local reader processes
(`sdk/backends/reader_processes.py`) check what they load; the vLLM engine checks each adapter version it hot-loads
against its worker's own copy (`sampling/vllm_engine.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from tinkerless.errors import TinkerlessError
from tinkerless.functions.precision import dtype_name  # (no torch at import: precision loads it when used)
from tinkerless.wire.messages import Datum, ForwardRequest

PROOF_FILE = "proof.json"
PROBE_LENGTH = 16
# How far a reader's probe log-probs may be from the writer's: the same weights in the same dtype on the same
# kind of device agree to float rounding; bf16 kernels on different GPUs may differ a little more.
TOLERANCE = {"fp32": 1e-3, "bf16": 5e-2}
# vLLM against the worker's own copy: other kernels (fused, paged attention), bf16 throughout, so a wider band.
# Still far below what a skipped or stale adapter moves a trained policy's probe by (tests/test_async_pipeline.py).
ENGINE_TOLERANCE = 0.25


class WeightSyncError(TinkerlessError):
    """A reader's copy of a policy version is not the one its writer committed."""


@dataclass(frozen=True)
class VersionProof:
    policy: str
    version: int
    adapter_sha256: str
    probe_tokens: list[int]
    probe_logprobs: list[float]
    dtype: str

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "VersionProof":
        return cls(**json.loads(data))


def adapter_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """A policy state's adapter files: what a reader loads (not the writer's optimizer or RNG)."""
    return {name: data for name, data in files.items() if name.startswith("adapter/")}


def adapter_digest(files: dict[str, bytes]) -> str:
    """sha256 over the adapter's own files (names and bytes), not the optimizer or RNG a reader never loads."""
    digest = hashlib.sha256()
    for name in sorted(adapter_files(files)):
        digest.update(name.encode() + b"\0" + len(files[name]).to_bytes(8, "little") + files[name])
    return digest.hexdigest()


def probe_tokens(vocab_size: int) -> list[int]:
    """A fixed sequence spread over the vocabulary, the same for every policy and version of a model."""
    return [(7919 * i + 17) % vocab_size for i in range(PROBE_LENGTH)]


def probe_logprobs(worker: Any, policy: str, tokens: list[int]) -> list[float]:
    ids = np.asarray(tokens, np.int32)
    result = worker.forward(ForwardRequest(policy, [Datum(ids, np.ones(len(ids), np.float32))]))
    return [float(v) for v in result.logprobs[0][1:]]  # entry 0 has no prefix


def probe(worker: Any, policy: str) -> tuple[list[int], list[float]]:
    """The probe tokens and `worker`'s log-probs of them under `policy` as it is now."""
    tokens = probe_tokens(worker.vocab_size)
    return tokens, probe_logprobs(worker, policy, tokens)


def make_proof(worker: Any, policy: str, version: int, files: dict[str, bytes]) -> VersionProof:
    """The writer's proof of `version` of `policy`, whose state it has just saved as `files`."""
    tokens, logprobs = probe(worker, policy)
    return VersionProof(policy, version, adapter_digest(files), tokens, logprobs, dtype_name(worker.dtype))


def check_files(proof: VersionProof, policy: str, version: int, files: dict[str, bytes]) -> None:
    """Before loading: the files are the ones the writer committed for this policy and version."""
    if (proof.policy, proof.version) != (policy, version):
        raise WeightSyncError(
            f"policy {policy!r} version {version}: the proof beside its files is for {proof.policy!r} version "
            f"{proof.version}", hint="the shared storage holds mixed-up versions; this is a bug, see the logs")
    found = adapter_digest(files)
    if found != proof.adapter_sha256:
        raise WeightSyncError(
            f"policy {policy!r} version {version}: its adapter files hash to {found[:16]}..., the writer committed "
            f"{proof.adapter_sha256[:16]}...", hint="a copy of the files is stale or torn; nothing was sampled from it")


def check_loaded(worker: Any, proof: VersionProof) -> float:
    """After loading: this worker's probe log-probs equal the writer's within the dtype's tolerance. The largest
    difference, which the caller may log."""
    ours = probe_logprobs(worker, proof.policy, proof.probe_tokens)
    dtypes = {proof.dtype, dtype_name(worker.dtype)}
    tolerance = max(TOLERANCE.get(d, TOLERANCE["bf16"]) for d in dtypes)
    return compare_probe(proof.policy, proof.version, ours, proof.probe_logprobs, tolerance,
                         who="this worker", against="the writer's", precision="/".join(sorted(dtypes)))


def compare_probe(policy: str, version: int | str, ours: list[float], theirs: list[float], tolerance: float, *,
                  who: str, against: str, precision: str) -> float:
    """The largest difference between two sets of probe log-probs, or a `WeightSyncError` naming both."""
    if len(ours) != len(theirs):
        gap = float("inf")  # not even the same probe
    else:
        gap = float(np.max(np.abs(np.asarray(ours) - np.asarray(theirs)))) if ours else 0.0
    if not gap <= tolerance:
        raise WeightSyncError(
            f"policy {policy!r} version {version}: after loading, {who}'s log-probs of the probe sequence differ from "
            f"{against} by {gap:.3g} (tolerance {tolerance:g} for {precision}): "
            f"ours {[round(v, 4) for v in ours[:4]]}..., {against} {[round(v, 4) for v in theirs[:4]]}...",
            hint="the loaded adapter is not the one the writer trained (another base model or precision?)")
    return gap
