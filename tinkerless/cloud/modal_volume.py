"""Policy state on a Modal Volume: one directory per committed adapter version.

Layout under the store root (``<volume>/adapters/<model key>/``)::

    <policy>/v<version>/adapter/adapter_config.json, adapter/adapter_model.safetensors,
                        optimizer.pt, worker_rng.pt
    <policy>/latest.json                       {"version": n}

The single writer (the update container) writes a version into a temp
directory, renames it into place and then commits the Volume, so a reader
never sees a half-written version. Readers (rollout, forward) ask for an
exact version; if it is not visible yet they reload the Volume once.
Pure Python with injected `commit`/`reload` hooks, so it runs on a plain
directory in tests and offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from tinkerless.errors import StorageNotFound, UserError

_TMP_PREFIX = ".tmp-"
VOLUME_MOUNT = "/tinkerless"  # where every container mounts the Volume


def model_key(model: str) -> str:
    """A short directory name for a model spec: adapters of different base models never mix."""
    return hashlib.sha256(model.encode()).hexdigest()[:12]


def _noop() -> None:
    pass


class AdapterStore:
    """Versioned policy state files under `root`, with Volume commit/reload hooks."""

    def __init__(
        self,
        root: str | Path,
        *,
        commit: Callable[[], None] = _noop,
        reload: Callable[[], None] = _noop,
        keep: int = 2,
    ):
        self.root = Path(root)
        self.commit = commit
        self.reload = reload
        self.keep = max(1, keep)

    def _policy_dir(self, policy: str) -> Path:
        if not policy or "/" in policy or policy.startswith(".") or policy != os.path.basename(policy):
            raise UserError(f"policy name {policy!r} cannot name a directory", hint="letters, digits, '-' and '_'")
        return self.root / policy

    def write(self, policy: str, version: int, files: dict[str, bytes]) -> Path:
        """Write one version atomically, point `latest` at it, prune old versions, commit."""
        directory = self._policy_dir(policy)
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"v{version}"
        tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=directory))
        try:
            for name, blob in files.items():
                if name.startswith("/") or ".." in name.split("/"):
                    raise UserError(f"state file name {name!r} leaves its directory")
                path = tmp / name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(blob)
            if target.exists():  # the same version written again (e.g. a retried call): replace it whole
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        latest = directory / "latest.json"
        latest_tmp = directory / f"{_TMP_PREFIX}latest.json"
        latest_tmp.write_text(json.dumps({"version": version}))
        os.replace(latest_tmp, latest)
        self._prune(directory, version)
        self.commit()
        return target

    def read(self, policy: str, version: int) -> dict[str, bytes]:
        """The files of exactly this version; reloads the Volume once if it is not visible yet."""
        target = self._policy_dir(policy) / f"v{version}"
        if not target.is_dir():
            self.reload()
        if not target.is_dir():
            have = self.versions(policy)
            raise StorageNotFound(
                f"adapter {policy!r} version {version} is not on the Modal Volume at {target} (have: {have or 'none'})",
                hint="the update container commits each version before it replies; if its container was lost "
                "before that, resume the run from its last checkpoint",
            )
        files = {}
        for path in sorted(target.rglob("*")):
            if path.is_file():
                files[path.relative_to(target).as_posix()] = path.read_bytes()
        return files

    def latest(self, policy: str) -> int | None:
        try:
            return int(json.loads((self._policy_dir(policy) / "latest.json").read_text())["version"])
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def versions(self, policy: str) -> list[int]:
        directory = self._policy_dir(policy)
        if not directory.is_dir():
            return []
        return sorted(int(p.name[1:]) for p in directory.iterdir() if p.is_dir() and p.name[1:].isdigit() and p.name[0] == "v")

    def _prune(self, directory: Path, newest: int) -> None:
        # Keep the newest `keep` versions: a reader that started just before a commit still finds its version.
        for version in self.versions(directory.name):
            if version <= newest - self.keep:
                shutil.rmtree(directory / f"v{version}", ignore_errors=True)
        for stale in directory.glob(f"{_TMP_PREFIX}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
