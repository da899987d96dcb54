"""`tinkerless export`: a checkpoint as a PEFT adapter (plain peft loads it) or merged weights (plain transformers).

Each export is loaded back with the library alone, on a base model built fresh from its saved directory
(not from the worker), and its logits are compared with the worker's own logits for the same input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import tinkerless
from tinkerless.errors import ConfigError, StorageError, StorageNotFound, UserError
from tinkerless.functions.models import build_tiny_model
from tinkerless.sdk.backends.base import LocalBackend
from tinkerless.sdk.cli.commands import main
from tinkerless.sdk.evaluation.evaluate import load_checkpoint

MESSAGES = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "It is 5, I think."}]


def _vowels(completion, task):
    # Vowels, plus a little for any ASCII: the tiny random model's byte soup rarely holds a vowel, and a group whose
    # rewards all tie trains nothing; this varies within every group whatever the draws.
    return sum((c in "aeiou") + 0.1 * c.isascii() for c in completion) / max(len(completion), 1)


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """A 2-step run `ex` whose adapter visibly moved (a large learning rate on the tiny model)."""
    storage = tmp_path_factory.mktemp("export-store")
    tinkerless.train(
        model=tiny_model, reward=_vowels, tasks=[{"prompt": "say a word"}, {"prompt": "name a fruit"}], steps=2,
        batch_size=2, group_size=4, max_tokens=8, temperature=1.0, learning_rate=0.1, storage=str(storage),
        progress=False, run_id="ex", checkpoint_every=1, keep_checkpoints=None,
    )
    return tiny_model, storage


@pytest.fixture(scope="module")
def input_ids(tiny_model):
    ids = AutoTokenizer.from_pretrained(tiny_model).apply_chat_template(MESSAGES, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return torch.tensor([list(ids)])


def _worker_logits(model: str, storage: Path, step: int, ids: torch.Tensor) -> torch.Tensor:
    """The logits the worker computes with checkpoint `step` loaded, as it does for training and sampling."""
    backend = LocalBackend(model)
    assert load_checkpoint(backend, tinkerless.TrainConfig(model=model, storage=str(storage)), "ex", step) == step
    worker = backend.worker
    with torch.no_grad(), worker._activate("default"):
        return worker.model(input_ids=ids).logits


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_adapter_loads_with_plain_peft_and_gives_the_workers_logits(run, input_ids, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel

    model, storage = run
    out = tmp_path / "adapter"
    result = tinkerless.export("ex@2", out, storage=str(storage))
    assert (result.run_id, result.step, result.merged) == ("ex", 2, False)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(Path(model).resolve()) == result.base_model
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"

    expected = _worker_logits(model, storage, 2, input_ids)
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(model), input_ids)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter changes the model: the comparison means something
    fresh_base = AutoModelForCausalLM.from_pretrained(model)  # built from the saved base, not the worker's copy
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(fresh_base, out), input_ids), expected, rtol=0, atol=1e-5)
    # The config alone is enough to find the base model.
    torch.testing.assert_close(_logits(AutoPeftModelForCausalLM.from_pretrained(out), input_ids), expected, rtol=0, atol=1e-5)


def test_merged_weights_load_with_plain_transformers(run, input_ids, tmp_path):
    model, storage = run
    out = tmp_path / "merged"
    assert tinkerless.export("ex@latest", out, storage=str(storage), merged=True).step == 2
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer_config.json"} <= names
    assert "adapter_config.json" not in names
    merged = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(_logits(merged, input_ids), _worker_logits(model, storage, 2, input_ids), rtol=0, atol=1e-4)
    # The tokenizer renders chats exactly as the base model's (chat template included).
    original, exported = AutoTokenizer.from_pretrained(model), AutoTokenizer.from_pretrained(out)
    render = lambda tok: tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)  # noqa: E731
    assert render(exported) == render(original) and exported.eos_token == original.eos_token


def test_cli_export_of_an_earlier_step(run, tmp_path, capsys):
    _, storage = run
    out = tmp_path / "step1"
    assert main(["export", "ex@1", str(out), "--storage", str(storage)]) == 0
    assert "exported run ex step 1 as a PEFT adapter" in capsys.readouterr().out
    step1 = load_file(out / "adapter_model.safetensors")
    step2 = load_file(tinkerless.export("ex@2", tmp_path / "step2", storage=str(storage)).path / "adapter_model.safetensors")
    assert step1.keys() == step2.keys() and any(not torch.equal(step1[k], step2[k]) for k in step1)
    provenance = json.loads((out / "tinkerless_export.json").read_text())
    assert provenance["run_id"] == "ex" and provenance["step"] == 1


def test_an_empty_existing_directory_is_fine(run, tmp_path):
    _, storage = run
    (tmp_path / "empty").mkdir()
    assert (tinkerless.export("ex@1", tmp_path / "empty", storage=str(storage)).path / "adapter_config.json").is_file()


# ---- bad input: nothing already there is touched, nothing half-written is left ---------------------


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".export-" in p.name]


def test_non_empty_target_is_refused_and_kept(run, tmp_path, capsys):
    _, storage = run
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="is not empty; nothing was written") as caught:
        tinkerless.export("ex@1", out, storage=str(storage))
    assert "new or empty directory" in caught.value.hint
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    assert main(["export", "ex@1", str(tmp_path / "file"), "--storage", str(storage)]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "file").read_text() == "x"
    assert _leftovers(tmp_path) == []


def test_a_failed_export_leaves_nothing(run, tmp_path, monkeypatch):
    from tinkerless.sdk.checkpoints import export as export_module

    _, storage = run

    def broken(files, model, directory):
        (directory / "config.json").write_text("{}")  # half-way through
        raise OSError("disk full")

    monkeypatch.setattr(export_module, "_write_merged", broken)
    with pytest.raises(StorageError, match="disk full; nothing was written there"):
        tinkerless.export("ex@1", tmp_path / "merged", storage=str(storage), merged=True)
    assert not (tmp_path / "merged").exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize(
    "ref, error, fragment",
    [
        ("nope@1", UserError, "run 'nope' does not exist"),
        ("ex@9", StorageNotFound, r"no checkpoint for step 9 .*available steps: \[1, 2\]"),
        ("base", UserError, "has no adapter to export"),
        ("ex", UserError, "names no step"),
    ],
)
def test_unknown_run_step_or_reference(run, tmp_path, ref, error, fragment):
    _, storage = run
    with pytest.raises(error, match=fragment):
        tinkerless.export(ref, tmp_path / "out", storage=str(storage))
    assert not (tmp_path / "out").exists()


def test_a_backend_export_cannot_read_is_refused(run, tmp_path):
    _, storage = run
    with pytest.raises(ConfigError, match="not backend 'sky'") as caught:
        tinkerless.export("ex@1", tmp_path / "out", storage=str(storage), backend="sky")
    assert "http://host:port" in caught.value.hint


def test_checkpoint_of_another_base_model_and_unknown_policy(run, tmp_path):
    model, storage = run
    other = build_tiny_model(tmp_path / "other", seed=1)
    with pytest.raises(UserError, match="was trained on base model") as caught:
        tinkerless.export("ex@1", tmp_path / "out", storage=str(storage), model=other)
    assert f"--model {model}" in caught.value.hint
    with pytest.raises(UserError, match="no adapter for policy 'learner'"):
        tinkerless.export("ex@1", tmp_path / "out", storage=str(storage), policy="learner")
    assert not (tmp_path / "out").exists()


def test_export_of_a_run_kept_by_a_server(tiny_model, worker, tmp_path):
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app
    from tinkerless.server import serve_in_thread as running

    server = tmp_path / "server"
    with running(create_app(worker, storage=str(server))) as url:
        tinkerless.train(
            model=tiny_model, reward=_vowels, tasks=[{"prompt": "hi"}], steps=1, batch_size=1, group_size=4,
            max_tokens=8, temperature=1.0, learning_rate=0.1, storage=str(tmp_path / "client"), progress=False,
            run_id="served", backend=HTTPBackend(url),
        )
        result = tinkerless.export("served@latest", tmp_path / "out", backend=url)
    assert result.step == 1
    stored = next(server.rglob("runs/served/checkpoints/step-1*/adapter/adapter_model.safetensors"))
    exported, original = load_file(result.path / "adapter_model.safetensors"), load_safetensors(stored.read_bytes())
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)
