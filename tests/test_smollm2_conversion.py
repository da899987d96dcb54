"""The SmolLM2 conversion from the packaged GGUF: special tokens agree, and a stale cached copy is redone."""

from __future__ import annotations

import json

import pytest

from tinkerless.functions import models


@pytest.mark.parametrize("marker", [None, {"format": 1}, "not json", {"format": models._CONVERSION_FORMAT}])
def test_only_a_current_conversion_is_reused(tmp_path, monkeypatch, marker):
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))
    cached = tmp_path / "models" / models._SMOLLM2_CACHE_NAME
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    if marker is not None:
        (cached / models._CONVERSION_MARKER).write_text(marker if isinstance(marker, str) else json.dumps(marker))
    converted = []

    def convert(gguf_path, out_dir):
        converted.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / models._CONVERSION_MARKER).write_text(json.dumps({"format": models._CONVERSION_FORMAT}))

    monkeypatch.setattr(models, "_convert_gguf", convert)
    assert models.resolve_model("smollm2") == str(cached)
    current = marker == {"format": models._CONVERSION_FORMAT}
    assert len(converted) == (0 if current else 1)
    assert models._is_current_conversion(cached) and not list(cached.parent.glob(".tmp-*"))


@pytest.mark.slow
def test_stale_cached_conversion_is_converted_again(tmp_path, monkeypatch):
    """A copy written by the old conversion (no format marker, eos_token '<|im_start|>') is replaced, not used."""
    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))
    stale = tmp_path / "models" / "SmolLM2-135M-Instruct-f32"
    stale.mkdir(parents=True)
    (stale / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    (stale / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_start|>"}))

    path = models.resolve_model("smollm2")
    assert path == str(stale)
    marker = json.loads((stale / "tinkerless-conversion.json").read_text())
    assert marker["format"] == models._CONVERSION_FORMAT
    tokenizer_config = json.loads((stale / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["pad_token"] == "<|im_end|>" and tokenizer_config["clean_up_tokenization_spaces"] is False
    assert json.loads((stale / "config.json").read_text())["eos_token_id"] == 2
    assert json.loads((stale / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not list(stale.parent.glob(".tmp-*")), "the stale copy or a temp dir was left behind"
    # Current now: a second resolve does not convert again.
    before = (stale / "model.safetensors").stat().st_mtime_ns
    assert models.resolve_model("smollm2") == path and (stale / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_fresh_process_gets_the_right_tokenizer_from_the_cache():
    """What a Tinker client loads from the model directory: EOS is the end of turn, decoding keeps spaces."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models.resolve_model("smollm2"))
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tokenizer.eos_token_id == 2
    assert tokenizer.decode(tokenizer.encode("a , b .")) == "a , b ."
