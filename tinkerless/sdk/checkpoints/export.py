"""`export()`: a run's checkpoint as a standard PEFT adapter directory, or as merged full weights.

    tinkerless export my-run@20 out/adapter            # adapter_config.json + adapter_model.safetensors
    tinkerless export my-run@latest out/merged --merged  # model weights + config + tokenizer (chat template)

The adapter directory loads with plain `peft` (`PeftModel.from_pretrained(base, out)`); its
`base_model_name_or_path` is the base model's Hub id where it has one (SmolLM2), else the local
model directory the run trained on. The merged directory loads with plain `transformers`
(`AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(out)`; a vision-language model's with
`AutoModelForImageTextToText`, its image processor saved beside it) and needs no peft.

Everything is written into a temporary directory next to OUT and renamed into place at the end,
so a failed export leaves nothing half-written, and an OUT that already holds files is refused
before anything is read: nothing already there is touched.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tinkerless.errors import ConfigError, StorageError, UserError
from tinkerless.sdk.checkpoints.checkpoint_ref import CheckpointRef, check_base_model, find_run, parse_checkpoint, run_model

ADAPTER_PREFIX = "adapter/"
PROVENANCE_FILE = "tinkerless_export.json"  # which run, step and base model the files came from


@dataclass
class ExportResult:
    path: Path
    run_id: str
    step: int
    base_model: str  # as written into the adapter config: a Hub id or a local directory
    merged: bool

    def describe(self) -> str:
        kind = "merged model (transformers)" if self.merged else "PEFT adapter"
        return f"exported run {self.run_id} step {self.step} as a {kind} on {self.base_model} to {self.path}"


def export(
    checkpoint: str | CheckpointRef,
    out: str | Path,
    *,
    merged: bool = False,
    storage: str = ".",
    backend: str = "local",
    model: str | None = None,
    storage_options: dict | None = None,
    policy: str = "default",
) -> ExportResult:
    """Write checkpoint `checkpoint` ("RUN_ID@STEP" or "RUN_ID@latest") to the new directory `out`.

    The run lives in `storage`, or on the `tinkerless serve` server `backend="http://..."` names.
    `model`, if given, must be the run's base model. `policy` picks one policy of a multi-agent run."""
    ref = checkpoint if isinstance(checkpoint, CheckpointRef) else parse_checkpoint(checkpoint)
    if ref.is_base:
        raise UserError(
            "`base` has no adapter to export: it is the base model itself",
            hint="export a run's checkpoint (RUN_ID@STEP or RUN_ID@latest); the base model's weights are its own",
        )
    policy = check_policy_name(policy)
    out = Path(out).expanduser()
    _check_target(out)  # before anything is read: a refused target costs nothing
    files, step, trained_on = _read_adapter(ref, storage, backend, model, storage_options, policy)
    base_name = _base_model_name(trained_on)
    files[ADAPTER_PREFIX + "adapter_config.json"] = _with_base_model(files[ADAPTER_PREFIX + "adapter_config.json"], base_name)
    provenance = {"run_id": ref.run_id, "step": step, "base_model": base_name, "policy": policy, "merged": merged}

    def fill(directory: Path) -> None:
        if merged:
            _write_merged(files, trained_on, directory)
        else:
            _write_files(files, directory)
        (directory / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")

    _write_atomically(out, fill)
    return ExportResult(out, ref.run_id, step, base_name, merged)


# ---- reading the adapter ------------------------------------------------------------------


def _read_adapter(
    ref: CheckpointRef, storage: str, backend: str, model: str | None, storage_options: dict | None, policy: str
) -> tuple[dict[str, bytes], int, str]:
    """The checkpoint's adapter files (adapter/<name>), its step, and the base model the run trained."""
    if backend in ("local", "modal"):  # their runs live in `storage`, which this process reads itself
        return _from_storage(ref, storage, storage_options, model, policy)
    if isinstance(backend, str) and backend.startswith(("http://", "https://")):
        return _from_server(ref, backend, model, policy)
    raise ConfigError(
        f"export reads runs from storage or from a `tinkerless serve` server, not backend {backend!r}",
        hint="pass the run's --storage (local and Modal runs), or the server's URL as --backend http://host:port "
        "(a SkyPilot cluster's server too)",
    )


def _from_storage(
    ref: CheckpointRef, storage: str, storage_options: dict | None, model: str | None, policy: str
) -> tuple[dict[str, bytes], int, str]:
    """Read the checkpoint straight from storage (verified against its manifest); no model is loaded."""
    from tinkerless.coordinator import checkpoint_prefix
    from tinkerless.sdk.backends.run_host import StorageRunHost
    from tinkerless.storage import CheckpointStore, ObjectStore

    host = StorageRunHost(ObjectStore(storage, **(storage_options or {})), backend=None)
    trained_on = _run_base_model(find_run(host, ref.run_id), ref, model)
    checkpoints = CheckpointStore(host.store, checkpoint_prefix(ref.run_id))
    loaded = checkpoints.load(ref.step) if ref.step is not None else checkpoints.load_latest()
    if loaded is None:
        raise UserError(f"run {ref.run_id!r} has no valid checkpoint in {host.where}", hint="see `tinkerless runs`")
    prefix = "" if policy == "default" else f"policies/{policy}/"
    files = {k[len(prefix):]: v for k, v in loaded.files.items() if k.startswith(prefix + ADAPTER_PREFIX)}
    if not files:
        policies = sorted({k.split("/")[1] for k in loaded.files if k.startswith("policies/") and k.count("/") >= 3})
        raise UserError(
            f"checkpoint {ref.run_id}@{loaded.step} has no adapter for policy {policy!r}",
            hint=f"this run's policies: {', '.join(policies)} (pass policy=/--policy NAME)" if policies else
            "the checkpoint holds no adapter; export another step",
        )
    _require_adapter(files, f"{ref.run_id}@{loaded.step}")
    return files, loaded.step, trained_on


def _from_server(ref: CheckpointRef, url: str, model: str | None, policy: str) -> tuple[dict[str, bytes], int, str]:
    """The server loads the checkpoint from its storage onto its worker; the adapter comes back from there."""
    from tinkerless.sdk.backends.client import TrainingClient
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.sdk.backends.server_runs import ServerRunHost
    from tinkerless.wire.runs import CheckpointPolicy

    http = HTTPBackend(url)
    try:
        host = ServerRunHost(http)
        trained_on = _run_base_model(find_run(host, ref.run_id), ref, model)
        prefix = "" if policy == "default" else f"policies/{policy}/"
        # Loaded into a policy of this export's own, so a concurrent eval or export of the same tenant never
        # swaps the weights between the load and the read; freed afterwards (a server keeps what it is not told to free).
        own = TrainingClient(http, f"export-{secrets.token_hex(6)}", create=False)
        try:
            restored = host.checkpoints(ref.run_id).restore([CheckpointPolicy(policy, prefix, own.policy)], [], ref.step, driver=False)
            if restored.step is None:
                raise UserError(f"run {ref.run_id!r} has no valid checkpoint in {host.where}", hint="see `tinkerless runs --server URL`")
            state = own.save_state(include_optimizer=False)
        finally:
            own.delete()
    finally:
        http.close()
    files = {k: v for k, v in state.files.items() if k.startswith(ADAPTER_PREFIX)}
    _require_adapter(files, f"{ref.run_id}@{restored.step}")
    return files, restored.step, trained_on


def _run_base_model(state, ref: CheckpointRef, model: str | None) -> str:
    trained_on = run_model(state)
    if model is not None:
        check_base_model(state, model, f"run {ref.run_id!r}")
    if trained_on is None and model is None:
        raise UserError(f"run {ref.run_id!r} does not record its base model", hint="pass model=/--model NAME")
    return trained_on or model


def _require_adapter(files: dict[str, bytes], where: str) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if ADAPTER_PREFIX + name not in files:
            raise UserError(f"checkpoint {where} has no {name}", hint="export another step (see `tinkerless runs`)")


def _base_model_name(spec: str) -> str:
    """What `base_model_name_or_path` says: the Hub id where the model has one (SmolLM2 by any alias),
    else the local directory the run trained on (the built-in `tiny` model: its cache directory)."""
    from tinkerless.functions.models import TINY_MODEL, public_model_id, resolve_model

    local = Path(spec).expanduser()
    if public_model_id(spec) == spec and local.is_dir():
        return str(local.resolve())
    if spec == TINY_MODEL:
        return str(Path(resolve_model(spec)).resolve())
    return public_model_id(spec)


def _with_base_model(raw: bytes, base_name: str) -> bytes:
    config = json.loads(raw)
    config["base_model_name_or_path"] = base_name
    config["inference_mode"] = True
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


# ---- writing --------------------------------------------------------------------------------


def _write_files(files: dict[str, bytes], directory: Path) -> None:
    for key, data in files.items():
        name = key[len(ADAPTER_PREFIX):]
        if "/" in name or name in ("", ".", ".."):
            continue  # a checkpoint is data, not a path to follow
        (directory / name).write_bytes(data)


def _write_merged(files: dict[str, bytes], model: str, directory: Path) -> None:
    """The base model with the adapter folded into its weights, its generation config and its tokenizer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinkerless.functions.models import resolve_model

    from tinkerless.functions.vision.models import is_vision_model, load_image_processor

    source = resolve_model(model)
    vision = is_vision_model(source)  # a VLM: AutoModelForImageTextToText, and its image processor beside it
    if vision:
        from transformers import AutoModelForImageTextToText

        base = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="tinkerless-adapter-") as adapter_dir:
        _write_files(files, Path(adapter_dir))
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(directory)  # config.json, generation_config.json, model.safetensors
    # A fresh tokenizer: the worker's copy is set up for left-padded batches; this one is as shipped.
    AutoTokenizer.from_pretrained(source).save_pretrained(directory)
    if vision:
        load_image_processor(source).save_pretrained(directory)


def _check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"export target {out} is a file", hint="name a new directory (it is created)")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(
            f"export target {out} is not empty; nothing was written",
            hint="name a new or empty directory (the files there are left untouched)",
        )


def _write_atomically(out: Path, fill: Callable[[Path], None]) -> None:
    """Fill a temp directory next to `out`, then rename it into place (onto nothing, or an empty directory)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    except OSError as exc:
        raise UserError(f"cannot create export directory {out}: {exc}", hint="name a directory in a writable place") from exc
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the export from everyone else
        try:
            fill(tmp)
        except OSError as exc:  # disk full, permissions: the partial files go with the temp directory
            raise StorageError(f"export to {out} failed: {exc}; nothing was written there",
                               hint="check the free space and permissions where OUT is, then run it again") from exc
        try:
            os.rename(tmp, out)
        except OSError as exc:  # something appeared at `out` meanwhile: it is kept, the export is not
            raise UserError(
                f"export target {out} was created by someone else during the export; nothing was written there ({exc})",
                hint="name a new or empty directory",
            ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_policy_name(policy: str) -> str:
    if not isinstance(policy, str) or not policy or "/" in policy or policy in (".", ".."):
        raise ConfigError(f"invalid policy name {policy!r}", hint="a policy name of the run, e.g. default")
    return policy
