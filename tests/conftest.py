"""Shared fixtures: a tiny random model built offline once per session, and a hub-free environment."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a ~0.1M-parameter random Qwen2 model with a byte-level ChatML tokenizer."""
    from tinkerless.functions.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", hidden_size=64, num_layers=2, seed=0)


@pytest.fixture(scope="session")
def worker(tiny_model):
    """One in-process worker on the tiny model, shared by tests that only read from it."""
    from tinkerless.functions.worker import Worker

    return Worker(tiny_model)
