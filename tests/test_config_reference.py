"""The TrainConfig reference (docs/config.md), help for every CLI option, one error for a misspelled field, --model tiny."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

import tinkerless
from tinkerless.errors import ConfigError
from tinkerless.sdk.cli.commands import _parser, load_config, main
from tinkerless.sdk.config_reference import FIELD_DOCS, field_reference, render_markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_committed_reference_equals_the_generated_one():
    assert DOCS.read_text() == render_markdown(), "regenerate it: tinkerless config-reference > docs/config.md"


def test_every_field_is_documented_with_its_default():
    fields = {f.name: f for f in dataclasses.fields(tinkerless.TrainConfig)}
    entries = field_reference()
    assert [e["name"] for e in entries] == list(fields)
    for entry in entries:
        assert entry["doc"].strip(), f"TrainConfig.{entry['name']} has no meaning in the reference"
        field = fields[entry["name"]]
        if field.default is not dataclasses.MISSING:
            assert entry["default"] == repr(field.default)
    assert set(FIELD_DOCS) <= set(fields), f"docs for fields that no longer exist: {set(FIELD_DOCS) - set(fields)}"


def test_config_reference_command_prints_it(capsys):
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == render_markdown()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def test_every_option_of_every_command_has_help():
    subcommands = _subcommands(_parser())
    assert {"train", "serve", "keys", "runs", "eval", "config-reference"} <= set(subcommands)
    for name, sub in subcommands.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and action.help.strip(), f"`tinkerless {name} {action.option_strings or action.dest}` has no help"
        sub.format_help()  # a stray % in a help string would raise here


def test_train_help_shows_each_flag_meaning_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "--batch-size" in out and "Tasks per step" in out and "--transcripts-per-step" in out
    assert "tiny" in out and "config-reference" in out


BAD_FILE = """\
import tinkerless
config = tinkerless.TrainConfig(
    modle="smollm2", reward=lambda c, t: 0.0, tasks=[{"prompt": "hi"}],
)
"""


def test_misspelled_field_is_one_config_error_in_file_and_in_train(tmp_path, capsys):
    file = tmp_path / "bad.py"
    file.write_text(BAD_FILE)
    with pytest.raises(ConfigError) as from_file:
        load_config(str(file))
    with pytest.raises(ConfigError) as from_train:
        tinkerless.train(modle="smollm2", reward=lambda c, t: 0.0, tasks=[{"prompt": "hi"}])
    with pytest.raises(ConfigError) as from_replace:
        tinkerless.TrainConfig().replace(modle="smollm2")
    for caught in (from_file, from_train, from_replace):
        assert "unknown TrainConfig setting: 'modle' (did you mean 'model'?)" in caught.value.message
        assert "docs/config.md" in caught.value.hint
    assert f"{file}, line 2" in from_file.value.message  # the file form says where
    assert main(["train", str(file)]) == 2
    assert "did you mean 'model'" in capsys.readouterr().err


def test_unknown_fields_without_a_close_match_and_several_at_once():
    with pytest.raises(ConfigError) as caught:
        tinkerless.TrainConfig(zzzz=1, learnig_rate=0.1)
    assert "settings: 'zzzz', 'learnig_rate' (did you mean 'learning_rate'?)" in caught.value.message


def test_tiny_model_is_built_offline_and_trains(tmp_path, monkeypatch, capsys):
    from tinkerless.functions.models import resolve_model

    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path / "cache"))
    path = Path(resolve_model("tiny"))
    assert path.is_relative_to(tmp_path / "cache") and (path / "config.json").is_file()
    assert resolve_model("tiny") == str(path)  # built once, then reused
    file = tmp_path / "quick.py"
    file.write_text(
        "import tinkerless\n"
        "config = tinkerless.TrainConfig(reward=lambda c, t: float(len(c)), tasks=[{'prompt': 'hi'}],\n"
        f"    steps=1, batch_size=1, group_size=2, max_tokens=4, storage={str(tmp_path)!r}, progress=False)\n"
    )
    assert main(["train", str(file), "--model", "tiny", "--run-id", "quick"]) == 0
    assert "run quick finished" in capsys.readouterr().out
