"""The Tinker REST surface, driven by the SDK's RestClient and by the SDK's own CLI (`tinker ...`)
against a live `tinkerless serve` on 127.0.0.1: sessions, checkpoint listings, weights info,
external-weights download, TTLs, deletes, and a typed 404 for every route that does not exist."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinkerless.functions.models import build_tiny_model  # noqa: E402
from tinkerless.functions.worker import Worker  # noqa: E402
from tinkerless.server import create_app, serve_in_thread  # noqa: E402
from tinkerless.server.keys import KeyStore  # noqa: E402
from tinkerless.storage import ObjectStore  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"
REPO = Path(__file__).resolve().parent.parent
CLI_VENV = REPO / ".venv-tinker-cli"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker-rest")
    model = build_tiny_model(root / "model", hidden_size=64, num_layers=2, seed=0, initializer_range=0.2)
    keys = KeyStore(ObjectStore(str(root / "storage")))
    alice, bob = keys.create("alice"), keys.create("bob")
    app = create_app(Worker(model), keys=keys, storage=str(root / "storage"))
    with serve_in_thread(app) as url:
        yield {"url": url, "alice": alice, "bob": bob, "model": model}


@pytest.fixture(scope="module")
def trained(server):
    """One run of alice's with a training checkpoint and a sampler checkpoint."""
    service = tinker.ServiceClient(base_url=server["url"], api_key=server["alice"],
                                   user_metadata={"purpose": "rest-test"})
    training = service.create_lora_training_client(base_model=server["model"], rank=4, seed=3).result()
    tokens = [5, 6, 7, 8, 9, 10, 11]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 6})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = training.save_state("step1").result().path
    sampler = training.save_weights_for_sampler("step1").result().path
    yield {"service": service, "training": training, "state": state, "sampler": sampler,
           "run_id": training.model_id, "session_id": training.model_id.split(":train:")[0]}
    service.close(status="success")


@pytest.fixture(scope="module")
def cli_python() -> str:
    """The python of .venv-tinker-cli, where the SDK's CLI runs with the click >= 8.2 it needs (skypilot pins
    click < 8.2 in this venv). scripts/install.sh makes it; made here if missing (seconds: click only)."""
    python = CLI_VENV / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m, sys; import tinker.cli.__main__; "
             "sys.exit(tuple(map(int, m.version('click').split('.')[:2])) < (8, 2))"]
    if python.exists() and subprocess.run(check, capture_output=True, timeout=300).returncode == 0:
        return str(python)
    made = subprocess.run(["bash", str(REPO / "scripts" / "tinker_cli_venv.sh"), sys.executable],
                          capture_output=True, text=True, timeout=600)
    if made.returncode != 0:
        pytest.skip(f"could not make {CLI_VENV} for the tinker CLI (run scripts/install.sh):\n{made.stderr[-2000:]}")
    return str(python)


@pytest.fixture(scope="module")
def cli(server, cli_python):
    """`cli(key, *args)` runs `tinker *args` (the SDK's own CLI) against the server as the key's tenant."""
    def run(key: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "TINKER_BASE_URL": server["url"], "TINKER_API_KEY": key, "TINKER_TELEMETRY": "0"}
        result = subprocess.run([cli_python, "-m", "tinker.cli", *args], env=env, capture_output=True, text=True,
                                timeout=300)
        if check:
            assert result.returncode == 0, f"tinker {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
        return result

    return run


def test_rest_client_lists_sessions_checkpoints_and_weights_info(server, trained):
    rest = tinker.ServiceClient(base_url=server["url"], api_key=server["alice"]).create_rest_client()
    listing = rest.list_user_checkpoints().result()
    assert {c.tinker_path for c in listing.checkpoints} >= {trained["state"], trained["sampler"]}
    assert listing.cursor.total_count == len(listing.checkpoints)
    assert [c.time for c in listing.checkpoints] == sorted((c.time for c in listing.checkpoints), reverse=True)
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert len(page.checkpoints) == 1 and page.checkpoints[0].tinker_path == listing.checkpoints[1].tinker_path

    assert trained["session_id"] in rest.list_sessions().result().sessions
    session = rest.get_session(trained["session_id"]).result()
    assert trained["run_id"] in session.training_run_ids
    assert session.user_metadata == {"purpose": "rest-test"}

    info = rest.get_weights_info_by_tinker_path(trained["state"]).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (server["model"], True, 4)
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, True)


def test_another_tenant_sees_none_of_it(server, trained):
    rest = tinker.ServiceClient(base_url=server["url"], api_key=server["bob"]).create_rest_client()
    assert rest.list_user_checkpoints().result().checkpoints == []
    assert trained["session_id"] not in rest.list_sessions().result().sessions
    with pytest.raises(tinker.NotFoundError):
        rest.get_session(trained["session_id"]).result()
    with pytest.raises(tinker.BadRequestError, match="no checkpoint"):
        rest.get_weights_info_by_tinker_path(trained["state"]).result()


def test_cli_lists_runs_and_checkpoints(server, trained, cli):
    listed = json.loads(cli(server["alice"], "--format", "json", "checkpoint", "list").stdout)
    paths = {c["tinker_path"] for c in listed["checkpoints"]}
    assert {trained["state"], trained["sampler"]} <= paths
    per_run = json.loads(cli(server["alice"], "--format", "json", "checkpoint", "list",
                             "--run-id", trained["run_id"]).stdout)
    assert {c["tinker_path"] for c in per_run["checkpoints"]} >= {trained["state"], trained["sampler"]}
    runs = json.loads(cli(server["alice"], "--format", "json", "run", "list").stdout)
    assert trained["run_id"] in {r["training_run_id"] for r in runs["runs"]}


def test_cli_downloads_a_training_checkpoint_as_a_loadable_peft_adapter(server, trained, cli, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    cli(server["alice"], "checkpoint", "download", trained["state"], "--output", str(tmp_path))
    (folder,) = tmp_path.iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == server["model"]
    assert "lm_head" in config["target_modules"]  # train_unembed defaults to true, as in Tinker
    # The exported tensors are the trained adapter's, and PEFT loads them onto the base model.
    weights = load_file(folder / "adapter_model.safetensors")
    assert not any("embed_tokens" in k for k in weights)  # only the LoRA weights, not the frozen embedding
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(server["model"]), str(folder))
    tokens = [5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0].log_softmax(-1)
    ours = logits.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    theirs = trained["training"].forward(
        [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                     loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 6})], "cross_entropy"
    ).result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(ours, theirs, atol=1e-4)
    # The CLI's temporary export was deleted after the download.
    listed = json.loads(cli(server["alice"], "--format", "json", "checkpoint", "list").stdout)
    assert not any("external_weights" in c["tinker_path"] for c in listed["checkpoints"])


def test_external_weights_urls_are_signed_and_expire_with_their_checkpoint(server, trained):
    export = trained["training"].save_weights_external("export").result().path
    assert export == f"tinker://{trained['run_id']}/external_weights/export"
    rest = tinker.ServiceClient(base_url=server["url"], api_key=server["alice"]).create_rest_client()
    urls = rest.get_external_weights_urls(export).result()
    assert set(urls.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    url = urls.urls["adapter_config.json"]
    assert json.loads(httpx.get(url).content)["peft_type"] == "LORA"
    # A link is bound to its file, its checkpoint and this server's key: any change is refused.
    assert httpx.get(url.replace("adapter_config.json", "adapter_model.safetensors")).status_code == 403
    token = url.split("/external_weights/")[1].split("/")[0]
    forged = url.replace(token, token[:-2] + ("AA" if token[-2:] != "AA" else "BB"))
    assert httpx.get(forged).status_code == 403
    # TTLs: in range is kept and reported; out of range is a user error.
    rest.set_checkpoint_ttl_from_tinker_path(export, 7200).result()
    (listed,) = [c for c in rest.list_checkpoints(trained["run_id"]).result().checkpoints if c.tinker_path == export]
    assert listed.expires_at is not None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.set_checkpoint_ttl_from_tinker_path(export, 5).result()
    rest.delete_checkpoint_from_tinker_path(export).result()
    assert httpx.get(url).status_code == 403  # the checkpoint is gone, so is its file


def _listed(cli, key) -> set[str]:
    return {c["tinker_path"] for c in json.loads(cli(key, "--format", "json", "checkpoint", "list").stdout)["checkpoints"]}


def test_cli_deletes_checkpoints_by_path_and_by_run(server, trained, cli):
    training = trained["training"]
    first, second = (training.save_state(name).result().path for name in ("cli-delete-1", "cli-delete-2"))
    # Another tenant's CLI cannot delete them: it fails and they stay.
    refused = json.loads(cli(server["bob"], "--format", "json", "checkpoint", "delete", first, "--yes").stdout)
    assert refused["deleted_count"] == 0 and [f["tinker_path"] for f in refused["failed"]] == [first]
    assert "not found" in refused["failed"][0]["error"]  # never says whose it is
    assert {first, second} <= _listed(cli, server["alice"])
    # Several paths in one call.
    cli(server["alice"], "checkpoint", "delete", first, second, "--yes")
    assert not {first, second} & _listed(cli, server["alice"])
    # A run's checkpoints of one type, then all of them (the CLI lists the run, filters, deletes each).
    other = trained["service"].create_lora_training_client(base_model=server["model"], rank=4).result()
    state, sampler = other.save_state("s").result().path, other.save_weights_for_sampler("s").result().path
    cli(server["alice"], "checkpoint", "delete", "--run-id", other.model_id, "--type", "sampler_weights", "--yes")
    left = _listed(cli, server["alice"])
    assert sampler not in left and state in left and trained["sampler"] in left  # only that run's, of that type
    cli(server["alice"], "checkpoint", "delete", "--run-id", other.model_id, "--yes")
    left = _listed(cli, server["alice"])
    assert state not in left and {trained["state"], trained["sampler"]} <= left


def test_delete_as_the_cli_does(server, trained, cli):
    """`tinker checkpoint delete PATH` is RestClient.delete_checkpoint_from_tinker_path per path."""
    extra = trained["training"].save_state("to-delete").result().path
    rest = tinker.ServiceClient(base_url=server["url"], api_key=server["alice"]).create_rest_client()
    with pytest.raises(tinker.NotFoundError):  # someone else's checkpoint is not theirs to delete
        tinker.ServiceClient(base_url=server["url"], api_key=server["bob"]).create_rest_client() \
            .delete_checkpoint_from_tinker_path(extra).result()
    rest.delete_checkpoint_from_tinker_path(extra).result()
    listed = json.loads(cli(server["alice"], "--format", "json", "checkpoint", "list").stdout)
    assert extra not in {c["tinker_path"] for c in listed["checkpoints"]}
    assert trained["state"] in {c["tinker_path"] for c in listed["checkpoints"]}


def test_sampler_weights_cannot_seed_a_training_client(server, trained):
    with pytest.raises(tinker.BadRequestError, match="holds no training state"):
        trained["service"].create_training_client_from_state(trained["sampler"]).result()


@pytest.mark.parametrize("method, path", [
    ("GET", "/api/v1/no_such_route"),
    ("POST", "/api/v1/sessions/search"),
    ("GET", "/api/v1/create_model"),  # a real route, the wrong method
    ("DELETE", "/api/v1/billing/usage/checkpoints/current"),
])
def test_unsupported_routes_answer_a_typed_error_naming_them(server, method, path):
    response = httpx.request(method, server["url"] + path, headers={"X-API-Key": server["alice"]})
    assert response.status_code == 404
    body = response.json()
    assert body["category"] == "user" and f"{method} {path}" in body["error"]
    assert "detail" not in body
