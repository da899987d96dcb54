"""The frozen base model on the ranks of a sharded update, without any rank holding all of it.

Loading the model whole on every rank (`from_pretrained`, then FSDP2 cuts it) puts every weight in every rank.
Where the file's dtype is the run's, transformers memory-maps it and the ranks share its pages; where the weights
are cast while loading (an fp32 checkpoint trained in bf16), each rank holds a private copy of the whole model
until it is sharded: N copies for N ranks, 8 x 140 GB for a 70B model. Instead each rank:
1. builds the model from its config with placeholder weights (`placeholder_model`): every base parameter has its
   true shape and dtype but one element of memory (a zero expanded to the shape). peft wraps it as it would the
   real model, so each policy's LoRA weights are made, seeded and cast exactly as on one process;
2. is sharded by FSDP2 over the meta device (`RankWorker._shard`, with `parameters_to_meta` and `materialize`),
   keeping memory for its 1/N of every parameter only;
3. reads its 1/N of each base weight from the checkpoint's safetensors files into its shard (`fill`): safetensors
   reads row ranges from the memory-mapped file, so no rank reads a whole tensor, and casts only those rows.

A checkpoint that does not match the model one name and shape for one parameter (a .bin checkpoint, names that
transformers renames or fuses while loading, a quantized model, an index that is not a map of keys to files of
the directory) gives None from `placeholder_model`, and the rank loads the model whole as before.
TINKERLESS_WHOLE_BASE_ON_RANKS=1 forces that (a comparison, or a way round a checkpoint this reads wrongly).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from tinkerless.functions.models import finish_loading, resolve_model

log = logging.getLogger(__name__)

# Set on each module that owns placeholder parameters: {parameter name in the module: its checkpoint key}. A module
# attribute, because FSDP2 and peft replace the parameters (and their attributes) but keep the modules.
_KEYS_ATTRIBUTE = "_tinkerless_checkpoint_keys"


@dataclass
class Checkpoint:
    """Where each base weight of a model lies: the safetensors file holding each key, and the key's shape."""

    directory: Path
    file_of: dict[str, str] = field(default_factory=dict)
    shape_of: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def read(cls, directory: Path) -> Checkpoint | None:
        """The checkpoint's table of contents (headers only), or None where it is not safetensors."""
        from safetensors import safe_open

        files = _weight_files(directory)
        if files is None or not all((directory / name).is_file() for name in files):
            return None
        found = cls(directory)
        for name in files:
            with safe_open(directory / name, framework="pt") as handle:
                for key in handle.keys():
                    found.file_of[key] = name
                    found.shape_of[key] = tuple(handle.get_slice(key).get_shape())
        return found

    @contextlib.contextmanager
    def opened(self) -> Iterator[dict[str, Any]]:
        """Every file of the checkpoint open (memory-mapped), by name."""
        from safetensors import safe_open

        with contextlib.ExitStack() as stack:
            yield {name: stack.enter_context(safe_open(self.directory / name, framework="pt"))
                   for name in sorted(set(self.file_of.values()))}


def _weight_files(directory: Path) -> list[str] | None:
    """The safetensors files of a checkpoint directory, picked as `from_pretrained` picks them: `model.safetensors`
    where it exists (an index beside it is not read), else the files its index names. None where neither is
    there, or the index is not a map of keys to plain file names in this directory."""
    if (directory / "model.safetensors").is_file():
        return ["model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no weight_map, not a map
        return None
    if not all(isinstance(name, str) and name and Path(name).name == name for name in names):
        return None  # a path, not a file of this directory: the whole load reports it
    return sorted(names)


def whole_model_forced() -> bool:
    return os.environ.get("TINKERLESS_WHOLE_BASE_ON_RANKS", "") not in ("", "0")


def placeholder_model(spec: str, dtype: torch.dtype) -> tuple[Any, Any, Checkpoint] | None:
    """The model `spec` with placeholder base weights, its tokenizer, and where its real weights lie; or None (with a
    log line saying why) where the checkpoint cannot be read in shards and the model must be loaded whole."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if whole_model_forced():
        return None
    source = _local_directory(spec)
    if source is None:
        return None
    config = AutoConfig.from_pretrained(source)
    if getattr(config, "quantization_config", None) is not None:
        return _whole(spec, "it is quantized")
    checkpoint = Checkpoint.read(source)
    if checkpoint is None:
        return _whole(spec, "its weights are not safetensors")
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kept_fp32 = [*(getattr(model, "_keep_in_fp32_modules", None) or []), *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    if kept_fp32 and dtype != torch.float32:  # from_pretrained keeps these in fp32 whatever the run's dtype
        return _whole(spec, f"transformers keeps {kept_fp32} of it in fp32")
    missing = _use_placeholders(model, checkpoint)
    if missing:
        return _whole(spec, f"{len(missing)} parameters have no checkpoint key of their name and shape ({missing[0]}, ...)")
    _load_saved_buffers(model, checkpoint)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json: the one from_config made from the config stands
        pass
    tokenizer = AutoTokenizer.from_pretrained(source)
    return (*finish_loading(model, tokenizer, device="cpu"), checkpoint)


# The files of a Hub repository besides its weights that from_pretrained reads: configs, the weights' index,
# tokenizer files.
_HUB_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def _local_directory(spec: str) -> Path | None:
    """The directory holding `spec`'s files: itself, or a Hub id's snapshot in the HF cache (downloaded if it is not
    there and the Hub can be reached). None where there is none: the whole load then reports why."""
    source = resolve_model(spec)
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    try:
        # A single weights file comes with the configs; an index's files after it, only those it names: not every
        # .safetensors file (some repositories also carry the original, consolidated weights, a second copy).
        directory = Path(snapshot_download(source, allow_patterns=[*_HUB_FILES, "model.safetensors"]))
        files = _weight_files(directory)
        if files is None:
            return _whole(spec, "no safetensors weights, or an index that names none")
        return Path(snapshot_download(source, allow_patterns=files))
    except Exception as exc:  # noqa: BLE001 - offline, no such repository, no access: from_pretrained says which
        return _whole(spec, f"no local copy of its files ({type(exc).__name__})")


def _whole(spec: str, why: str) -> None:
    log.warning("model %s is loaded whole by every rank before it is sharded (not each rank its rows): %s", spec, why)
    return None


@torch.no_grad()
def _load_saved_buffers(model: Any, checkpoint: Checkpoint) -> None:
    """Persistent buffers the checkpoint holds take its values, as from_pretrained gives them (small: read whole).
    Non-persistent ones (rotary frequencies) keep what init computed, as from_pretrained ignores them in a file."""
    persistent = set(model.state_dict())
    with checkpoint.opened() as files:
        for name, buffer in model.named_buffers():
            if name in persistent and checkpoint.shape_of.get(name) == tuple(buffer.shape):
                buffer.copy_(files[checkpoint.file_of[name]].get_tensor(name).to(buffer.dtype))


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built in this block get their parameters on the meta device (no memory, no init cost) and their
    buffers as usual: non-persistent buffers such as rotary frequencies are computed at init, not loaded.

    accelerate's `init_empty_weights(include_buffers=False)` does this too, but it wraps a parameter that is on
    the meta device already in a new object, so an output head tied to the embedding stops being the same one."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _use_placeholders(model: Any, checkpoint: Checkpoint) -> list[str]:
    """Each module notes its parameters' checkpoint keys and every parameter becomes a one-element placeholder of
    its shape. Returns the parameters the checkpoint has no key for (then nothing is replaced)."""
    names: dict[int, list[str]] = {}  # a parameter's names: several where it is tied (embedding and output head)
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    missing = []
    for module_name, module in model.named_modules():
        keys = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            key = next((k for k in names[id(param)] if checkpoint.shape_of.get(k) == tuple(param.shape)), None)
            if key is None:
                missing.append(f"{module_name}.{name}".lstrip("."))
            else:
                keys[name] = key
        if keys:
            setattr(module, _KEYS_ATTRIBUTE, keys)
    if not missing:
        _replace_parameters(model, lambda param: torch.zeros((), dtype=param.dtype).expand(param.shape))
    return missing


def parameters_to_meta(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter (placeholders and LoRA weights) onto the meta device, so that FSDP2 shards them without
    memory (it refuses a placeholder: not contiguous); returns a copy of every buffer, for `materialize`. The LoRA
    weights' values are the caller's to load back (`RankWorker._shard`)."""
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    _replace_parameters(model, lambda param: torch.empty(param.shape, dtype=param.dtype, device="meta"))
    return buffers


def _replace_parameters(model: Any, make: Callable[[torch.nn.Parameter], torch.Tensor]) -> None:
    """Each parameter replaced by a new one holding `make(parameter)`, in every module that holds it: a tied
    parameter stays one object (`Module.to` would make the embedding and the output head two)."""
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = torch.nn.Parameter(make(param), requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


@torch.no_grad()
def materialize(model: Any, device: str, buffers: dict[str, torch.Tensor]) -> None:
    """Memory on `device` for the rank's shard of every parameter (uninitialized until `fill` and the LoRA weights
    load), as torchtitan makes an FSDP2 model built on the meta device: `to_empty`, which FSDP2 follows (each
    sharded module re-registers its shards). `to_empty` empties the buffers too: their values come back."""
    model.to_empty(device=device)
    for name, buffer in model.named_buffers():
        buffer.copy_(buffers[name])


def rows_of_rank(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, stop) of a tensor that FSDP2 keeps on `rank`: torch.chunk's split of dim 0 (ceil(rows / N)
    a rank, the last ranks fewer or none)."""
    per_rank = -(-rows // world_size)
    start = min(rows, rank * per_rank)
    return start, min(rows, start + per_rank)


@torch.no_grad()
def fill(model: Any, checkpoint: Checkpoint) -> int:
    """Copy each placeholder parameter's real values from the checkpoint: this rank's rows of a sharded parameter,
    the whole of one that is not sharded. Returns the number of elements read."""
    read, filled = 0, {}  # filled: id of a parameter (before) -> the parameter filled (tied ones are filled once)
    with checkpoint.opened() as files:
        for module in model.modules():
            for name, key in getattr(module, _KEYS_ATTRIBUTE, {}).items():
                param = module._parameters[name]
                if id(param) not in filled:
                    kept, destination, (start, stop) = _rows_held(param)
                    source = files[checkpoint.file_of[key]].get_slice(key)
                    values = source[start:stop] if param.dim() else source[...]
                    destination.copy_(values.to(destination.dtype))
                    read += values.numel()
                    filled[id(param)] = kept
                module._parameters[name] = filled[id(param)]
    return read


def _rows_held(param: Any) -> tuple[Any, torch.Tensor, tuple[int, int]]:
    """The parameter the module keeps, the tensor this rank's part of it is copied into, and the rows of the whole
    that part is: a sharded parameter, its local tensor and its rows; for one that is not sharded, a new parameter
    of real memory in place of the placeholder, and every row."""
    if not hasattr(param, "device_mesh"):
        whole = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=param.device),
                                   requires_grad=param.requires_grad)
        return whole, whole.data, (0, param.shape[0] if param.dim() else 0)
    from torch.distributed.tensor import Shard

    if len(param.placements) != 1 or param.placements[0] != Shard(0):
        raise NotImplementedError(f"a parameter sharded as {param.placements}: the ranks shard dim 0 over one mesh")
    mesh = param.device_mesh
    start, stop = rows_of_rank(param.shape[0], mesh.get_local_rank(), mesh.size())
    local = param.to_local()
    if local.shape[0] != stop - start:
        raise RuntimeError(f"FSDP2 kept {local.shape[0]} rows of {tuple(param.shape)} on this rank, not {stop - start}")
    return param, local, (start, stop)
