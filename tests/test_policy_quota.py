"""A tenant's policies on a shared server are bounded, can be freed, and an evaluation or export loads into a
policy of its own.

Every LoRA policy holds an adapter and an optimizer in the memory all tenants share; before the quota, one
tenant creating policies in a loop (through /v1/call, the Tinker API or `load_state`) could exhaust it.
"""

from __future__ import annotations

import pytest

import tinkerless
from tinkerless.errors import RemoteError, UserError
from tinkerless.functions.worker import Worker
from tinkerless.sdk.backends.base import call
from tinkerless.sdk.backends.client import TrainingClient
from tinkerless.sdk.backends.http import HTTPBackend
from tinkerless.server import create_app, serve_in_thread
from tinkerless.server.keys import KeyStore
from tinkerless.server.limits import ServingLimits
from tinkerless.storage import ObjectStore
from tinkerless.wire.messages import (
    DeletePolicyRequest, LoadStateRequest, LoraConfig, PolicyState, SampleRequest, SamplingParams,
)

pytestmark = pytest.mark.timeout(300)
QUOTA = 3


@pytest.fixture(scope="module")
def shared(tiny_model, tmp_path_factory):
    storage = tmp_path_factory.mktemp("quota-server")
    keys = KeyStore(ObjectStore(str(storage)))
    alice, bob, carol = keys.create("alice"), keys.create("bob"), keys.create("carol")
    worker = Worker(tiny_model)
    app = create_app(worker, keys=keys, storage=str(storage), limits=ServingLimits(max_policies_per_tenant=QUOTA))
    with serve_in_thread(app) as url:
        yield {"url": url, "alice": alice, "bob": bob, "carol": carol, "worker": worker, "storage": storage}


def _backend(shared, who: str) -> HTTPBackend:
    return HTTPBackend(shared["url"], api_key=shared[who])


def test_a_tenant_over_its_policy_quota_gets_a_400_naming_the_flag_and_others_are_untouched(shared):
    alice, bob = _backend(shared, "alice"), _backend(shared, "bob")
    try:
        clients = [TrainingClient(alice, f"p{i}", LoraConfig(rank=2, seed=i)) for i in range(QUOTA)]
        before = len(shared["worker"].policies)
        # Every way a tenant creates a policy is counted: create_policy, and load_state into a new name.
        with pytest.raises(RemoteError) as created:
            TrainingClient(alice, "one-too-many", LoraConfig(rank=2))
        assert created.value.category == "user"
        assert "max_policies_per_tenant" in created.value.message and "--max-policies-per-tenant" in (created.value.hint or "")
        state = clients[0].save_state(include_optimizer=False)
        with pytest.raises(RemoteError) as loaded:
            call(alice, "load_state", LoadStateRequest(PolicyState("loaded-copy", state.files), include_optimizer=False))
        assert loaded.value.category == "user" and "max_policies_per_tenant" in loaded.value.message
        assert len(shared["worker"].policies) == before  # nothing half-made
        # Existing policies keep working; another tenant has a quota of its own.
        assert call(alice, "sample", SampleRequest("p1", [[5, 6]], 1, SamplingParams(max_tokens=2), seed=0)).sequences
        TrainingClient(bob, "p0", LoraConfig(rank=2))
        # Freeing one makes room again; its name is gone from the tenant's listing.
        assert clients[0].delete() is True
        assert "p0" not in call(alice, "info", {})["policies"]
        TrainingClient(alice, "fits-now", LoraConfig(rank=2))
        assert clients[0].delete() is False  # already gone
    finally:
        alice.close(), bob.close()


def test_a_tenant_cannot_delete_another_tenants_policy_or_the_base_model(shared):
    alice, bob = _backend(shared, "alice"), _backend(shared, "bob")
    try:
        TrainingClient(bob, "keep", LoraConfig(rank=2))
        # Alice's "keep" is her own (absent) policy: bob's is untouched.
        assert call(alice, "delete_policy", DeletePolicyRequest("keep"))["deleted"] is False
        assert "keep" in call(bob, "info", {})["policies"]
        with pytest.raises(UserError, match="base model"):
            call(alice, "delete_policy", DeletePolicyRequest("base"))
    finally:
        alice.close(), bob.close()


def test_a_finished_run_frees_its_policies_and_eval_uses_and_frees_a_policy_of_its_own(
    shared, tiny_model, tmp_path, monkeypatch
):
    monkeypatch.setenv("TINKERLESS_API_KEY", shared["carol"])
    worker = shared["worker"]
    before = set(worker.policies)
    config = dict(model=tiny_model, tasks=[{"prompt": "hi"}], steps=2, batch_size=1, group_size=2, max_tokens=3, seed=0,
                  progress=False, storage=str(tmp_path), backend=shared["url"])
    result = tinkerless.train(reward=lambda completion, task: float(len(completion) % 3), run_id="freed", **config)
    assert result.last_checkpoint_step == 2
    assert set(worker.policies) == before, "the run's policies stayed on the server after it finished"
    report = tinkerless.evaluate(
        tinkerless.TrainConfig(reward=lambda completion, task: 0.0, **config), checkpoint="freed@latest", samples=1
    )
    assert report.step == 2 and report.played
    assert set(worker.policies) == before, "the evaluation's policy stayed on the server"


def test_deleting_a_policy_that_is_sampling_is_refused(tiny_model):
    import threading

    worker = Worker(tiny_model)
    worker.create_policy(tinkerless.wire.messages.CreatePolicyRequest("pa", LoraConfig(rank=2)))
    worker.create_policy(tinkerless.wire.messages.CreatePolicyRequest("pb", LoraConfig(rank=2)))
    batcher = worker.engine.batcher
    started, release = threading.Event(), threading.Event()
    original = batcher.step

    def slow_step():  # hold the generation between decode steps, as a time slice would
        started.set()
        release.wait(30)
        return original()

    batcher.step = slow_step
    thread = threading.Thread(target=lambda: worker.sample(SampleRequest("pa", [[5, 6]], 1, SamplingParams(max_tokens=2), seed=0)))
    thread.start()
    try:
        assert started.wait(30)
        assert "pa" in batcher.policies_in_use()
        with pytest.raises(tinkerless.errors.UserError, match="sampling right now"):
            worker.delete_policy(DeletePolicyRequest("pa"))
        assert worker.delete_policy(DeletePolicyRequest("pb")) == {"policy": "pb", "deleted": True}
    finally:
        release.set()
        thread.join(30)
    # Done sampling: deletable now (peft keeps a model's last adapter, so the worker says it kept it).
    assert worker.delete_policy(DeletePolicyRequest("pa")) == {"policy": "pa", "deleted": False}


def test_tinker_models_count_against_the_quota_and_a_silent_sessions_models_make_room(tiny_model, tmp_path):
    tinker = pytest.importorskip("tinker")
    storage = tmp_path / "storage"
    keys = KeyStore(ObjectStore(str(storage)))
    alice = keys.create("alice")
    app = create_app(Worker(tiny_model), keys=keys, storage=str(storage), limits=ServingLimits(max_policies_per_tenant=2))
    with serve_in_thread(app) as url:
        gone = tinker.ServiceClient(base_url=url, api_key=alice)
        old = [gone.create_lora_training_client(base_model=tiny_model, rank=2).result() for _ in range(2)]
        live = tinker.ServiceClient(base_url=url, api_key=alice)
        try:
            # At the quota, with every session still heartbeating: refused, and the hint says what to do.
            with pytest.raises(Exception) as refused:
                live.create_lora_training_client(base_model=tiny_model, rank=2).result()
            assert "max_policies_per_tenant" in str(refused.value)
            # The first client goes away: its session falls silent (aged here instead of waiting 120 s).
            service = app.state.tinker
            first_session = old[0].model_id.split(":train:")[0]
            service.sessions[first_session]["seen"] -= 10 * 120.0
            fresh = live.create_lora_training_client(base_model=tiny_model, rank=2).result()
            assert fresh.get_info().model_id == fresh.model_id
            # Both of the silent session's models were freed; using one says so and what to do instead.
            assert old[0].model_id not in service.models and old[1].model_id not in service.models
            with pytest.raises(Exception) as freed:
                old[0].optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result()
            assert "was freed" in str(freed.value)
        finally:
            live.close(status="success"), gone.close(status="success")
