"""A Tinker client that shares nothing with the server: another process, another HOME, another
Hugging Face cache, no path into the server's storage or model directory. It names the model by
its Hub id, loads the tokenizer from its own (offline) cache as it would after a download, and
trains and samples through the official SDK.

The tiny variant serves a tiny model under a Hub-style id from the server's own HF cache (the id
plumbing); the slow variant does the same for the real SmolLM2, installed in the client's cache by
`python -m tinkerless.functions.hf_cache`, the step scripts/install.sh runs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("tinker")

from tinkerless.functions.hf_cache import place_in_hf_cache  # noqa: E402
from tinkerless.functions.models import SMOLLM2_HUB_ID, build_tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY_ID = "tinkerless-test/tiny-chatml"


def isolated_env(home: Path) -> dict[str, str]:
    """A process environment with its own HOME and caches, offline, importing this checkout."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TINKER", "TRANSFORMERS", "XDG_"))}
    return {**keep, "HOME": str(home), "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TINKER_TELEMETRY": "0", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path, model: str, storage: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tinkerless.sdk.cli.commands", "serve", "--model", model, "--port", str(port),
         "--storage", str(storage), "--no-auth"],
        env=isolated_env(home), cwd=storage, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{process.stdout.read()}")
        try:
            if httpx.get(url + "/api/v1/healthz", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the server did not start in time")


CLIENT = textwrap.dedent('''
    import json, os, sys
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    url, model_id, alias = sys.argv[1], sys.argv[2], sys.argv[3] or None
    out = {}
    # The cookbook's way: the tokenizer by Hub id, from this process's own cache, offline.
    out["hub_tokenizer_eos"] = AutoTokenizer.from_pretrained(model_id).eos_token
    client = tinker.ServiceClient(base_url=url, api_key="tml-remote-client")
    training = client.create_lora_training_client(base_model=model_id, rank=4)
    info = training.get_info()
    out["tokenizer_id"] = info.model_data.tokenizer_id
    out["model_name"] = info.model_data.model_name
    tokenizer = training.get_tokenizer()
    out["training_tokenizer_eos"] = tokenizer.eos_token
    tokens = tokenizer.encode("hello there, remote client", add_special_tokens=False)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    losses = []
    for _ in range(2):
        losses.append(training.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out["losses"] = losses
    sampler = training.save_weights_and_get_sampling_client()
    out["sampler_base_model"] = sampler.get_base_model()
    out["sampler_tokenizer_eos"] = sampler.get_tokenizer().eos_token
    result = sampler.sample(types.ModelInput.from_ints(tokens), 1, types.SamplingParams(max_tokens=4, seed=1)).result()
    out["sampled"] = sampler.get_tokenizer().decode(result.sequences[0].tokens)
    if alias:  # a short alias names the same model, and the server still answers with the Hub id
        aliased = client.create_lora_training_client(base_model=alias, rank=4)
        out["alias_tokenizer_id"] = aliased.get_info().model_data.tokenizer_id
    out["capabilities"] = [m.model_name for m in client.create_rest_client()
                           .get_server_capabilities().result().supported_models]
    client.close(status="success")
    print("RESULT" + json.dumps(out))
''')


def run_client(home: Path, url: str, model_id: str, alias: str = "") -> dict:
    result = subprocess.run([sys.executable, "-c", CLIENT, url, model_id, alias], env=isolated_env(home),
                            cwd=home, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT")]
    return json.loads(line[len("RESULT"):])


def check_remote_view(out: dict, model_id: str, server_paths: list[Path]) -> None:
    assert out["tokenizer_id"] == out["model_name"] == out["sampler_base_model"] == model_id
    assert out["capabilities"] == [model_id]
    assert out["losses"][1] < out["losses"][0]
    assert out["hub_tokenizer_eos"] == out["training_tokenizer_eos"] == out["sampler_tokenizer_eos"]
    text = json.dumps(out)
    assert not any(str(path) in text for path in server_paths)  # nothing the client sees is a server path


def test_a_client_on_another_home_uses_the_hub_id_end_to_end(tmp_path):
    server_home, client_home, storage = tmp_path / "server-home", tmp_path / "client-home", tmp_path / "storage"
    for directory in (server_home, client_home, storage):
        directory.mkdir()
    model_dir = build_tiny_model(tmp_path / "built" / "tiny", hidden_size=64, num_layers=2, seed=0)
    # Each machine has the model in its own HF cache under the Hub id (as after a download).
    place_in_hf_cache(model_dir, TINY_ID, server_home / ".cache" / "huggingface" / "hub")
    place_in_hf_cache(model_dir, TINY_ID, client_home / ".cache" / "huggingface" / "hub")
    process, url = start_server(server_home, TINY_ID, storage)
    try:
        out = run_client(client_home, url, TINY_ID)
    finally:
        process.terminate()
        process.wait(timeout=30)
    check_remote_view(out, TINY_ID, [server_home, storage, Path(model_dir)])
    assert out["hub_tokenizer_eos"] == "<|im_end|>"


def test_placing_in_the_hf_cache_is_idempotent_and_resolves_offline(tmp_path, tiny_model):
    from huggingface_hub import try_to_load_from_cache

    cache = tmp_path / "hub"
    first = place_in_hf_cache(tiny_model, TINY_ID, cache)
    assert place_in_hf_cache(tiny_model, TINY_ID, cache) == first
    repo = cache / ("models--" + TINY_ID.replace("/", "--"))
    assert (repo / "refs" / "main").read_text() == first.name
    assert all(p.is_symlink() and p.resolve().parent == repo / "blobs" for p in first.iterdir())
    resolved = try_to_load_from_cache(TINY_ID, "config.json", cache_dir=cache)
    assert Path(resolved).read_bytes() == (Path(tiny_model) / "config.json").read_bytes()
    with pytest.raises(ValueError, match="owner/name"):
        place_in_hf_cache(tiny_model, "no-owner", cache)


@pytest.mark.slow
def test_smollm2_by_hub_id_from_a_client_with_its_own_cache(tmp_path):
    """The real model: the client's install step fills its cache; the server's own cache is elsewhere."""
    client_home, storage = tmp_path / "client-home", tmp_path / "storage"
    client_home.mkdir(), storage.mkdir()
    install = subprocess.run([sys.executable, "-m", "tinkerless.functions.hf_cache", "smollm2"],
                             env=isolated_env(client_home), capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stdout + install.stderr
    process, url = start_server(Path.home(), "smollm2", storage)  # the server machine: its usual HOME
    try:
        out = run_client(client_home, url, SMOLLM2_HUB_ID, alias="smollm2")
    finally:
        process.terminate()
        process.wait(timeout=30)
    check_remote_view(out, SMOLLM2_HUB_ID, [Path.home() / ".cache" / "tinkerless", storage])
    assert out["alias_tokenizer_id"] == SMOLLM2_HUB_ID
    assert out["hub_tokenizer_eos"] == "<|im_end|>"  # the EOS the chat template ends turns with (id 2)


def test_the_public_name_of_a_model_is_its_hub_id(tmp_path, monkeypatch):
    from tinkerless.functions.models import model_aliases, public_model_id

    monkeypatch.setenv("TINKERLESS_CACHE", str(tmp_path))
    for name in ("smollm2", "smollm2-135m", "SmolLM2-135M-Instruct", SMOLLM2_HUB_ID,
                 str(tmp_path / "models" / "SmolLM2-135M-Instruct-f32")):  # the local conversion, by path
        assert public_model_id(name) == SMOLLM2_HUB_ID
        assert {"smollm2", SMOLLM2_HUB_ID} <= model_aliases(name)
    assert public_model_id("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_aliases("/some/local/model") == {"/some/local/model"}
