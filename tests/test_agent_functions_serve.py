"""One agent file: trained through `tinkerless serve --single-user`, then evaluated against that server's
OpenAI API with `tinkerless eval FILE --endpoint URL --model <run_id>@latest`."""

from __future__ import annotations

import json
import textwrap

import pytest

from tinkerless.functions.worker import Worker
from tinkerless.sdk.cli.commands import load_config, main
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.storage import ObjectStore

pytestmark = pytest.mark.timeout(600)

AGENT_FILE = """
import tinkerless

@tinkerless.agent
async def solve(client, task):
    messages = [{{"role": "user", "content": task["question"]}}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {{"role": "user", "content": "Again?"}}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    text = second.choices[0].message.content or ""
    return tinkerless.AgentResult(reward=float(len(text) % 3), metrics={{"chars": len(text)}})

config = tinkerless.TrainConfig(
    model={model!r}, agent=solve, tasks=[{{"question": "hi"}}, {{"question": "yo"}}],
    steps=1, batch_size=2, group_size=3, max_tokens=4, learning_rate=1e-2, checkpoint_every=1, progress=False,
)
"""


def test_train_through_single_user_serve_then_eval_the_same_file_against_its_openai_api(tiny_model, tmp_path, capsys):
    path = tmp_path / "agent_file.py"
    path.write_text(textwrap.dedent(AGENT_FILE.format(model=tiny_model)))
    storage = tmp_path / "server"
    keys = KeyStore(ObjectStore(str(storage)), extra_keys={"key-me": "me"})
    app = create_app(Worker(tiny_model), keys=keys, storage=str(storage))  # no user-code sandboxes: single-user
    with serve_in_thread(app) as url:
        config = load_config(str(path))
        from tinkerless.sdk.run.trainer import train

        result = train(config, backend=HTTPBackend(url, api_key="key-me"), run_id="agentrun", storage=str(tmp_path / "c"))
        (record,) = result.metrics
        assert record["episodes"] == 6 and record["episodes_error"] == 0 and "agent/chars" in record
        assert result.last_checkpoint_step == 1

        transcripts = tmp_path / "eval.jsonl"
        code = main(["eval", str(path), "--endpoint", f"{url}/v1", "--model", "agentrun@latest", "--api-key", "key-me",
                     "--episodes", "3", "--transcripts", str(transcripts)])
        out = capsys.readouterr().out
        assert code == 0, out
        assert "agentrun@latest" in out and "over 3 episodes (0 failed)" in out and "6 completion calls" in out
        lines = [json.loads(line) for line in transcripts.read_text().splitlines()]
        assert len(lines) == 3 and all(line["error"] is None for line in lines)
        for line in lines:
            first, second = line["calls"]
            assert first["request"]["model"] == "agentrun@latest"  # model="policy" went to --model
            assert second["request"]["messages"][1]["role"] == "assistant"

        # Another tenant's run is not reachable: every call is a 404, each episode fails with it.
        code = main(["eval", str(path), "--endpoint", f"{url}/v1", "--model", "someone-else@latest", "--api-key", "key-me",
                     "--episodes", "2"])
        out = capsys.readouterr().out
        assert code == 0 and "(2 failed)" in out and "NotFoundError" in out


def test_eval_of_an_agent_file_without_an_endpoint_says_how(tiny_model, tmp_path, capsys):
    path = tmp_path / "agent_file.py"
    path.write_text(textwrap.dedent(AGENT_FILE.format(model=tiny_model)))
    assert main(["eval", str(path)]) == 2
    assert "--endpoint" in capsys.readouterr().err
