"""The Modal settings: one validated object from which the Modal App is built.

Modal captures most decorator arguments (timeouts, retries, container limits)
in closures that are not inspectable before deploy, so these settings live
here, in plain dataclasses that are validated and unit-tested, and
`tinkerless.cloud.modal_app.build_app` passes them to the decorators
unchanged. Importing this module does not import modal.

Set it in Python (`ModalConfig(rollout=ClassSpec(gpu="H100", max_containers=16))`,
`ModalConfig().replace(gpu="A100-80GB")`) or from the environment for
`tinkerless train --backend modal` (`TINKERLESS_MODAL_GPU=H100`, see `from_env`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tinkerless.errors import ConfigError

# Modal's GPU names (modal.com/docs/guide/gpu); "!" and "+" pin the exact SKU.
GPU_TYPES = (
    "T4", "L4", "A10", "A10G", "L40S", "A100", "A100-40GB", "A100-80GB",
    "RTX-PRO-6000", "H100", "H100!", "H200", "B200", "B200+",
)  # fmt: skip
_MAX_GPUS = {"A10": 4, "A10G": 4}  # every other type goes up to 8 per container (Modal's per-type maximum)
MAX_TIMEOUT = 24 * 3600  # Modal's per-call limit
GPU_ROLES = ("rollout", "forward", "update")
ROLES = (*GPU_ROLES, "coordinator")
ENV_PREFIX = "TINKERLESS_MODAL_"
CONFIG_ENV = "TINKERLESS_MODAL_CONFIG"  # the resolved config as JSON, set in the image for containers


def client_python() -> str:
    """This interpreter's "major.minor": the image must match it, user code travels as pickles."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class ClassSpec:
    """Resources and scaling of one Modal class (one role)."""

    gpu: str | None = "L40S"  # None: CPU only
    gpu_count: int = 1
    timeout: int = 1800  # seconds one call may run
    retries: int = 1  # re-runs of a call whose container died
    min_containers: int = 0  # kept warm (billed) even when idle
    max_containers: int = 1
    scaledown_window: int = 300  # seconds an idle container waits before it stops
    cpu: float | None = None  # cores; None = Modal's default
    memory: int | None = None  # MiB; None = Modal's default

    def __post_init__(self) -> None:
        # "H100:4", Modal's own way of asking for several GPUs, is gpu="H100", gpu_count=4.
        if isinstance(self.gpu, str) and ":" in self.gpu:
            kind, _, count = self.gpu.partition(":")
            if not count.strip().isdigit():
                raise ConfigError(f"gpu={self.gpu!r}: the count after ':' must be a whole number", hint="e.g. 'H100:4'")
            if self.gpu_count not in (1, int(count)):
                raise ConfigError(f"gpu={self.gpu!r} and gpu_count={self.gpu_count!r} disagree",
                                  hint="give the count once: gpu='H100:4', or gpu='H100' with gpu_count=4")  # fmt: skip
            object.__setattr__(self, "gpu", kind.strip())
            object.__setattr__(self, "gpu_count", int(count))

    def gpu_request(self) -> str | None:
        """Modal's GPU string: "H100", "H100:2", or None."""
        if self.gpu is None:
            return None
        return self.gpu if self.gpu_count == 1 else f"{self.gpu}:{self.gpu_count}"

    def cls_options(self) -> dict[str, Any]:
        """Keyword arguments for `@app.cls(...)`, exactly as passed."""
        options: dict[str, Any] = {
            "gpu": self.gpu_request(),
            "timeout": self.timeout,
            "retries": self.retries,
            "min_containers": self.min_containers,
            "max_containers": self.max_containers,
            "scaledown_window": self.scaledown_window,
        }
        if self.cpu is not None:
            options["cpu"] = self.cpu
        if self.memory is not None:
            options["memory"] = self.memory
        return options

    def check(self, role: str) -> None:
        where = f"modal {role}"
        if self.gpu is not None and self.gpu not in GPU_TYPES:
            close = [g for g in GPU_TYPES if g.lower() == str(self.gpu).lower()]
            raise ConfigError(
                f"{where}: unknown GPU type {self.gpu!r}",
                hint=f"did you mean {close[0]!r}?" if close else f"one of {', '.join(GPU_TYPES)} (or None for CPU only)",
            )
        limit = _MAX_GPUS.get(self.gpu or "", 8)
        if not _is_int(self.gpu_count) or not 1 <= self.gpu_count <= limit:
            raise ConfigError(f"{where}: gpu_count must be 1..{limit} for {self.gpu}, got {self.gpu_count!r}",
                              hint=f"Modal gives a container at most {limit} {self.gpu} GPUs")  # fmt: skip
        if not _is_int(self.timeout) or not 10 <= self.timeout <= MAX_TIMEOUT:
            raise ConfigError(f"{where}: timeout must be 10..{MAX_TIMEOUT} seconds, got {self.timeout!r}")
        if not _is_int(self.retries) or not 0 <= self.retries <= 10:
            raise ConfigError(f"{where}: retries must be 0..10, got {self.retries!r}")
        if not _is_int(self.max_containers) or self.max_containers < 1:
            raise ConfigError(f"{where}: max_containers must be at least 1, got {self.max_containers!r}")
        if not _is_int(self.min_containers) or not 0 <= self.min_containers <= self.max_containers:
            raise ConfigError(
                f"{where}: min_containers must be 0..max_containers ({self.max_containers}), got {self.min_containers!r}",
                hint="min_containers keeps containers (and their GPUs) running and billed while idle",
            )
        if not _is_int(self.scaledown_window) or not 2 <= self.scaledown_window <= 3600:
            raise ConfigError(f"{where}: scaledown_window must be 2..3600 seconds, got {self.scaledown_window!r}")
        if self.cpu is not None and (isinstance(self.cpu, bool) or not isinstance(self.cpu, (int, float)) or self.cpu <= 0):
            raise ConfigError(f"{where}: cpu must be a positive number of cores, got {self.cpu!r}")
        if self.memory is not None and (not _is_int(self.memory) or self.memory < 128):
            raise ConfigError(f"{where}: memory must be at least 128 MiB, got {self.memory!r}")


@dataclass(frozen=True)
class ModalConfig:
    """Everything the Modal backend needs to know; validated on construction."""

    app_name: str = "tinkerless"
    volume_name: str = "tinkerless"  # adapters, run state and checkpoints, HF cache
    python_version: str = field(default_factory=client_python)
    rollout: ClassSpec = ClassSpec(max_containers=8)  # scales out: a big batch fans out over containers
    forward: ClassSpec = ClassSpec(max_containers=2)
    update: ClassSpec = ClassSpec(max_containers=1)  # the single trainer: owns adapters and optimizers
    coordinator: ClassSpec = ClassSpec(gpu=None, timeout=MAX_TIMEOUT, retries=3, max_containers=1, scaledown_window=60)
    tasks_per_container: int = 16  # a rollout with more tasks is split into chunks of this many
    keep_versions: int = 2  # adapter versions kept per policy on the Volume
    extras: tuple[str, ...] = ("s3",)  # optional dependency groups installed in the image ("vllm" for the vLLM engine)
    secrets: tuple[str, ...] = ()  # Modal Secret names set as env in every container (S3 keys, HF_TOKEN)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("app_name", "volume_name"):
            value = getattr(self, name)
            if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", value):
                raise ConfigError(f"modal {name} {value!r} is not a valid Modal name", hint="letters, digits, '.', '_', '-' (max 63)")
        if self.python_version != client_python():
            raise ConfigError(
                f"modal python_version {self.python_version!r} differs from this Python ({client_python()})",
                hint="envs, rewards and configs travel as pickles, which only load under the same Python minor version; "
                "leave python_version at its default or run the client with that Python",
            )
        for role in ROLES:
            spec = getattr(self, role)
            if not isinstance(spec, ClassSpec):
                raise ConfigError(f"modal {role} must be a ClassSpec, got {type(spec).__name__}")
            spec.check(role)
        if self.update.max_containers != 1:
            raise ConfigError(
                f"modal update.max_containers must be 1, got {self.update.max_containers}",
                hint="one container holds each policy's optimizer state and gradients; rollout and forward scale out instead",
            )
        if self.coordinator.max_containers != 1:
            raise ConfigError(f"modal coordinator.max_containers must be 1, got {self.coordinator.max_containers}",
                              hint="one coordinator owns a run's state")  # fmt: skip
        if not _is_int(self.tasks_per_container) or self.tasks_per_container < 1:
            raise ConfigError(f"modal tasks_per_container must be at least 1, got {self.tasks_per_container!r}")
        if not _is_int(self.keep_versions) or self.keep_versions < 1:
            raise ConfigError(f"modal keep_versions must be at least 1, got {self.keep_versions!r}")
        for name in ("extras", "secrets"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(e, str) and e for e in value):
                raise ConfigError(f"modal {name} must be a tuple of names, got {value!r}", hint=f"e.g. {name}=('a', 'b')")

    # ---- building -----------------------------------------------------------------
    def replace(self, **changes: Any) -> ModalConfig:
        """A changed copy. Roles take a ClassSpec or a dict of its fields; `gpu=`/`gpu_count=` set every GPU role."""
        top = {f.name for f in dataclasses.fields(self)}
        shortcuts = {k: changes.pop(k) for k in ("gpu", "gpu_count") if k in changes}
        unknown = set(changes) - top
        if unknown:
            raise ConfigError(f"unknown Modal setting(s) {sorted(unknown)}", hint=f"one of {', '.join(sorted(top | {'gpu', 'gpu_count'}))}")
        for role in ROLES:
            value = changes.get(role)
            if isinstance(value, Mapping):
                changes[role] = _replace_spec(getattr(self, role), role, value)
        for name in ("extras", "secrets"):  # a comma list (environment) or a list
            if isinstance(changes.get(name), (list, str)):
                value = changes[name]
                changes[name] = tuple(e.strip() for e in (value.split(",") if isinstance(value, str) else value) if e.strip())
        config = dataclasses.replace(self, **changes)
        if shortcuts:
            config = dataclasses.replace(
                config, **{role: _replace_spec(getattr(config, role), role, shortcuts) for role in GPU_ROLES}
            )
        return config

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ModalConfig:
        """Read `TINKERLESS_MODAL_*` variables.

        `TINKERLESS_MODAL_<FIELD>` sets a top-level field (APP_NAME, VOLUME_NAME, TASKS_PER_CONTAINER,
        KEEP_VERSIONS; EXTRAS and SECRETS as comma lists); `TINKERLESS_MODAL_GPU` / `_GPU_COUNT` set every GPU role;
        `TINKERLESS_MODAL_<ROLE>_<FIELD>` one role's field (e.g. ROLLOUT_MAX_CONTAINERS, UPDATE_GPU,
        COORDINATOR_TIMEOUT; "none" clears gpu/cpu/memory). A misspelled variable is an error.
        """
        environ = os.environ if environ is None else environ
        if environ.get(CONFIG_ENV):
            return cls.from_json(environ[CONFIG_ENV])
        spec_fields = {f.name: f for f in dataclasses.fields(ClassSpec)}
        top_fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ROLES and f.name != "python_version"}
        changes: dict[str, Any] = {}
        for key, raw in sorted(environ.items()):
            if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name in ("gpu", "gpu_count"):
                changes[name] = _parse(key, raw, spec_fields[name].type)
                continue
            if name in top_fields:
                changes[name] = raw if name in ("extras", "secrets") else _parse(key, raw, top_fields[name].type)
                continue
            role, _, attr = name.partition("_")
            if role in ROLES and attr in spec_fields:
                changes.setdefault(role, {})[attr] = _parse(key, raw, spec_fields[attr].type)
                continue
            raise ConfigError(
                f"unknown Modal setting {key}",
                hint=f"{ENV_PREFIX}GPU, {ENV_PREFIX}<ROLE>_<FIELD> (roles: {', '.join(ROLES)}; fields: "
                f"{', '.join(spec_fields)}) or {ENV_PREFIX}<{'|'.join(n.upper() for n in top_fields)}>",
            )
        return cls().replace(**changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModalConfig:
        try:
            data = json.loads(text)
            roles = {role: ClassSpec(**data.pop(role)) for role in ROLES}
            names = {name: tuple(data.pop(name, ())) for name in ("extras", "secrets")}
            return cls(**data, **roles, **names)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"unreadable Modal config JSON: {type(exc).__name__}: {exc}",
                              hint=f"let tinkerless write {CONFIG_ENV}; do not set it by hand") from exc  # fmt: skip

    def describe(self) -> str:
        """One line per role, for logs and the README."""
        lines = [f"app {self.app_name!r}, volume {self.volume_name!r}, Python {self.python_version}"
                 + (f", secrets {', '.join(self.secrets)}" if self.secrets else "")]  # fmt: skip
        for role in ROLES:
            s = getattr(self, role)
            lines.append(
                f"  {role:<11} gpu={s.gpu_request() or 'none'} containers={s.min_containers}..{s.max_containers} "
                f"timeout={s.timeout}s retries={s.retries} scaledown={s.scaledown_window}s"
            )
        return "\n".join(lines)


def _replace_spec(spec: ClassSpec, role: str, changes: Mapping[str, Any]) -> ClassSpec:
    names = {f.name for f in dataclasses.fields(ClassSpec)}
    unknown = set(changes) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)} for modal {role}", hint=f"one of {', '.join(sorted(names))}")
    return dataclasses.replace(spec, **changes)


def _parse(key: str, raw: str, kind: Any) -> Any:
    """Parse an environment value by the field's annotation (a string under `from __future__ import annotations`)."""
    text = raw.strip()
    kind = str(kind)
    if "None" in kind and text.lower() in ("", "none", "null"):
        return None
    try:
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number", hint=f"{key} takes {kind.split(' ')[0]}") from None
    return text


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["GPU_TYPES", "ROLES", "ClassSpec", "ModalConfig", "client_python"]
