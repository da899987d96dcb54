"""Shared fixtures: a tiny random model built offline once per session, and a hub-free environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


TRAIN_CLI = [sys.executable, "-m", "tinkerless.sdk.cli.commands", "train"]


def train_in_subprocess(example: Path, storage: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    """`tinkerless train EXAMPLE` as run id "r" in its own process, for kill-and-resume tests (wait: to its end)."""
    cmd = [*TRAIN_CLI, str(example), "--storage", str(storage), "--run-id", "r", "--no-progress", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # same thread count in every run: same float sums
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    return proc


def latest_checkpoint_step(storage: Path, run_id: str = "r") -> int:
    """The step of run `run_id`'s latest committed checkpoint (0 before the first)."""
    try:
        return json.loads((storage / "runs" / run_id / "checkpoints/latest").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def write_resumable_example(path: Path, model: str, steps: int) -> Path:
    """A config file for kill-and-resume tests: checkpoints every step, each step slow enough to be killed inside."""
    path.write_text(
        textwrap.dedent(
            f"""
            import time
            import tinkerless

            @tinkerless.reward
            def vowels(completion, task):
                time.sleep(0.03)  # keeps each step long enough to be killed inside it
                return sum(c in "aeiou" for c in completion) / max(len(completion), 1)

            config = tinkerless.TrainConfig(
                name="resumable", model={model!r}, reward=vowels,
                tasks=lambda rng: {{"prompt": "say " + str(rng.randint(0, 99))}},
                steps={steps}, batch_size=2, group_size=4, max_tokens=8, temperature=1.0,
                learning_rate=1e-2, checkpoint_every=1, keep_checkpoints=None, seed=7,
            )
            """
        )
    )
    return path


def build_other_vocabulary_model(path: Path) -> str:
    """A tiny random model with SmolLM2's tokenizer: another vocabulary than `tiny_model`'s byte-level one (a
    teacher that aligns by character spans)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tinkerless.functions.models import resolve_model

    if (path / "config.json").is_file():
        return str(path)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
