"""The sharded update (issue #27) on CPU: two ranks under FSDP2 with gloo, spawned processes, the tiny model.


- one sharded forward_backward + optim_step gives the single-process Worker's LoRA weights, optimizer moments,
  metrics and log-probs, to float tolerance (an odd number of micro-batches: a rank makes an idle pass; long
  rows recompute their layers in backward);
- a state saved by 2 ranks loads on 1 and training goes on as if never sharded, and the other way round; 3 ranks
  (uneven cuts, one rank with an empty shard of every LoRA A) step as one process and hand their state to 2;
- a rank that dies mid-step fails the call at once, naming the rank, and the policy stays at its last saved
  (committed) version; the ranks restart on the next call and train on from there.
"""

from __future__ import annotations

import functools
import json
import io
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from tinkerless.errors import RankFailed
from tinkerless.functions.losses import LossConfig
from tinkerless.functions.sharding.group import ShardedWorker
from tinkerless.functions.sharding.rank import merge_metrics
from tinkerless.functions.training.forward_backward import rank_rounds
from tinkerless.functions.worker import Worker
from tinkerless.wire import decode_message, encode_message
from tinkerless.wire.messages import (
    AdamParams,
    CreatePolicyRequest,
    DeletePolicyRequest,
    Datum,
    ForwardRequest,
    LoadStateRequest,
    LoraConfig,
    ResetPolicyRequest,
    SaveStateRequest,
    UpdateRequest,
)

LORA = LoraConfig(rank=4, alpha=8, seed=3)
ADAM = AdamParams(learning_rate=1e-2)
# In micro-batches of at most 2 rows and a 34-token budget (`small_budget`): [40] [15, 12] [9, 7] [6, 5] [4].
# The 40-token row recomputes its layers in backward while the other rank's micro-batch does not, and the
# count is odd, so rank 1 makes an idle pass in the last round.
LENGTHS = (5, 9, 12, 7, 15, 40, 4, 6)


def batch(seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in LENGTHS:
        tokens = rng.integers(0, 250, n).astype(np.int32)
        mask = np.zeros(n, np.float32)
        mask[n // 2 :] = 1
        advantages = (mask * rng.normal(size=n)).astype(np.float32)
        out.append(Datum(tokens, mask, advantages=advantages, sampler_logprobs=np.full(n, -1.0, np.float32)))
    return out


def weights(state) -> dict[str, torch.Tensor]:
    return load_safetensors(state.files["adapter/adapter_model.safetensors"])


# After a second step, on ranks: they sum the gradients in another order (the all-reduce), and Adam's early steps
# divide by sqrt(v), so a last-bit gradient difference reaches ~2e-6 (2.7e-5 relative) in a weight on some CPUs
# (AMD EPYC here; 1e-6 held on others). One step stays within the tight default.
AFTER_TWO_STEPS = dict(atol=1e-5, rtol=1e-4)


def assert_same_state(got, expected, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    a, b = weights(got), weights(expected)
    assert sorted(a) == sorted(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=rtol, msg=lambda m, key=key: f"{key}: {m}")
    ours, theirs = (torch.load(io.BytesIO(s.files["optimizer.pt"]), weights_only=True) for s in (got, expected))
    assert ours["param_groups"] == theirs["param_groups"] and sorted(ours["state"]) == sorted(theirs["state"])
    for i, entry in theirs["state"].items():
        for name, value in entry.items():
            torch.testing.assert_close(ours["state"][i][name], value, atol=atol, rtol=rtol,
                                       msg=lambda m, where=f"{i}.{name}": f"{where}: {m}")
    assert got.policy_version == expected.policy_version


@pytest.fixture(scope="module")
def small_budget():
    """A token budget under the 40-token row's length: it goes alone and recomputes its layers in backward."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TINKERLESS_ACTIVATION_MB", "0.4")  # 34 tokens of the tiny model; inherited by the ranks
        yield


@pytest.fixture(scope="module")
def reference(tiny_model, small_budget):
    """The single-process Worker after one and two updates (states saved after each)."""
    worker = Worker(tiny_model, micro_batch_size=2)
    worker.create_policy(CreatePolicyRequest("p", LORA))
    first = worker.update(UpdateRequest("p", batch(0), LossConfig(), ADAM))
    one = worker.save_state(SaveStateRequest("p"))
    logprobs = worker.forward(ForwardRequest("p", batch(0), with_reference=True))
    second = worker.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
    two = worker.save_state(SaveStateRequest("p"))
    return {"first": first, "one": one, "forward": logprobs, "second": second, "two": two}


@pytest.fixture(scope="module")
def sharded(tiny_model, small_budget):
    group = ShardedWorker(tiny_model, world_size=2, device="cpu", micro_batch_size=2, grace_s=5.0)
    yield group
    group.close()


def test_the_ranks_split_micro_batches_in_rounds():
    assert rank_rounds([0, 1, 2, 3, 4], 0, 2) == [0, 2, 4] and rank_rounds([0, 1, 2, 3, 4], 1, 2) == [1, 3, None]
    assert rank_rounds([0, 1], 0, 1) == [0, 1]
    merged = merge_metrics([{"loss": 0.5, "tokens": 3.0, "entropy": 2.0, "grad_norm": 1.0},
                            {"loss": 0.25, "tokens": 1.0, "entropy": 6.0, "grad_norm": 1.0}])  # fmt: skip
    assert merged == {"loss": 0.75, "tokens": 4.0, "entropy": 3.0, "grad_norm": 1.0}


def test_a_sharded_step_equals_the_single_process_step(sharded, reference):
    assert sharded.create_policy(CreatePolicyRequest("p", LORA)) == {"policy": "p", "created": True}
    result = sharded.update(UpdateRequest("p", batch(0), LossConfig(), ADAM))
    expected = reference["first"]
    assert result.policy_version == expected.policy_version == 1 and set(result.metrics) == set(expected.metrics)
    for key, value in expected.metrics.items():
        assert result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert_same_state(sharded.save_state(SaveStateRequest("p")), reference["one"])
    got = sharded.forward(ForwardRequest("p", batch(0), with_reference=True))
    for ours, theirs in zip(got.logprobs + got.ref_logprobs, reference["forward"].logprobs + reference["forward"].ref_logprobs):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    assert sharded.policies["p"].version == 1 and sharded.info()["policies"] == {"p": 1}


def test_saved_on_two_ranks_loads_on_one_and_the_other_way_round(tiny_model, sharded, reference):
    # The sharded group holds "p" at version 1 (previous test): its state goes to one process and trains on there.
    state = sharded.save_state(SaveStateRequest("p"))
    single = Worker(tiny_model, micro_batch_size=2)
    single.load_state(LoadStateRequest(state))
    single.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
    assert_same_state(single.save_state(SaveStateRequest("p")), reference["two"], **AFTER_TWO_STEPS)
    # A single process's state loads on the two ranks (as a policy they do not hold yet) and trains on there.
    moved = ShardedWorker(tiny_model, world_size=2, device="cpu", micro_batch_size=2)
    try:
        assert moved.load_state(LoadStateRequest(reference["one"])) == {"policy": "p", "policy_version": 1}
        moved.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
        assert_same_state(moved.save_state(SaveStateRequest("p")), reference["two"], **AFTER_TWO_STEPS)
    finally:
        moved.close()


def test_three_ranks_with_an_empty_shard_train_as_one_process_and_hand_their_state_to_two(tiny_model, reference):
    """Uneven cuts: a LoRA rank of 4 over 3 ranks is cut 2, 2, 0 (FSDP2's torch.chunk), so rank 2 holds no rows
    of any LoRA A matrix, and the tiny model's 64-wide layers split 22, 22, 20. The step and a state saved there
    and continued on 2 ranks equal the single process's."""
    three = ShardedWorker(tiny_model, world_size=3, device="cpu", micro_batch_size=2, grace_s=5.0)
    try:
        three.create_policy(CreatePolicyRequest("p", LORA))
        result = three.update(UpdateRequest("p", batch(0), LossConfig(), ADAM))
        for key, value in reference["first"].metrics.items():
            assert result.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        state = three.save_state(SaveStateRequest("p"))
    finally:
        three.close()
    assert_same_state(state, reference["one"])
    two = ShardedWorker(tiny_model, world_size=2, device="cpu", micro_batch_size=2)
    try:
        two.load_state(LoadStateRequest(state))
        two.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
        assert_same_state(two.save_state(SaveStateRequest("p")), reference["two"], **AFTER_TWO_STEPS)
    finally:
        two.close()


def refuse_fsdp_on_one_rank(worker) -> None:
    """A rank hook: forward_backward fails if the model was wrapped by FSDP2 (one rank must keep the plain model)."""
    original = worker.forward_backward

    def forward_backward(request):
        from torch.distributed.fsdp import FSDPModule

        if any(isinstance(m, FSDPModule) for m in worker.model.modules()):
            raise AssertionError("FSDP2 over one rank")
        return original(request)

    worker.forward_backward = forward_backward


def test_one_rank_keeps_the_plain_model_and_trains_as_one_process(tiny_model, small_budget, reference):
    """World size 1 (one GPU, or `serve --gpus 1`): the same process, pipe and gathers as N ranks, but no FSDP2
    (it would only add gathers and copies). A single process's state loads there and trains on identically, and a
    second policy is made in place, with no rebuild."""
    one = ShardedWorker(tiny_model, world_size=1, device="cpu", micro_batch_size=2, rank_hook=refuse_fsdp_on_one_rank)
    try:
        assert one.load_state(LoadStateRequest(reference["one"])) == {"policy": "p", "policy_version": 1}
        one.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
        assert_same_state(one.save_state(SaveStateRequest("p")), reference["two"], **AFTER_TWO_STEPS)
        assert one.create_policy(CreatePolicyRequest("q", LORA)) == {"policy": "q", "created": True}
        first = one.update(UpdateRequest("q", batch(0), LossConfig(), ADAM))
        for key, value in reference["first"].metrics.items():
            assert first.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert one.info()["policies"] == {"p": 2, "q": 1}
    finally:
        one.close()


def die_in_forward_backward(worker, marker: str) -> None:
    """A rank hook: rank 1 exits hard inside forward_backward once `marker` exists (rank 0 is then mid-step,
    in a collective that waits for rank 1)."""
    if worker.rank != 1:
        return
    original = worker.forward_backward

    def forward_backward(request):
        if os.path.exists(marker):
            os._exit(3)
        return original(request)

    worker.forward_backward = forward_backward


def test_a_rank_killed_mid_step_fails_the_call_naming_it_and_the_policy_stays_committed(tiny_model, tmp_path, reference):
    marker = tmp_path / "die"
    group = ShardedWorker(tiny_model, world_size=2, device="cpu", micro_batch_size=2,
                          rank_hook=functools.partial(die_in_forward_backward, marker=str(marker)))  # fmt: skip
    try:
        group.create_policy(CreatePolicyRequest("p", LORA))
        assert group.update(UpdateRequest("p", batch(0), LossConfig(), ADAM)).policy_version == 1
        group.save_state(SaveStateRequest("p"))  # committed: version 1
        marker.write_text("")
        started = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 of 2 died \(exit code 3\) during update") as error:
            group.update(UpdateRequest("p", batch(1), LossConfig(), ADAM))
        assert time.monotonic() - started < 60, "the failure is noticed at once, not after a collective timeout"
        assert "'p' v1" in str(error.value)
        assert group.policies["p"].version == 1 and not group.running  # the last committed version
        marker.unlink()
        # The next call starts the ranks again from the saved state and trains on from version 1.
        assert group.update(UpdateRequest("p", batch(1), LossConfig(), ADAM)).policy_version == 2
        assert_same_state(group.save_state(SaveStateRequest("p")), reference["two"], **AFTER_TWO_STEPS)
    finally:
        group.close()


def test_a_server_splits_its_gpus_between_a_sampler_and_the_ranks(tiny_model, reference):
    """`tinkerless serve --gpus 2`: a SplitWorker samples here and trains on two ranks; each new version is
    copied to the sampler, so what it samples and scores is the version the ranks just made."""
    from tinkerless.functions.sharding.split import SplitWorker
    from tinkerless.sdk.backends.http import HTTPBackend
    from tinkerless.server import create_app, serve_in_thread
    from tinkerless.wire.messages import SampleRequest, SamplingParams

    worker = SplitWorker(tiny_model, ranks=2, micro_batch_size=2)
    try:
        assert worker.info()["ranks"] == 2
        with serve_in_thread(create_app(worker, keys=None)) as url:
            http = HTTPBackend(url)
            decode = lambda method, request: decode_message(http.call_bytes(method, encode_message(request)))  # noqa: E731
            assert decode("create_policy", CreatePolicyRequest("p", LORA))["created"]
            assert decode("update", UpdateRequest("p", batch(0), LossConfig(), ADAM)).policy_version == 1
            assert worker.policies["p"].version == 1  # the sampler's copy moved with the ranks
            assert_same_state(decode("save_state", SaveStateRequest("p")), reference["one"])
            got = decode("forward", ForwardRequest("p", batch(0)))  # scored by the sampler's copy
            for ours, theirs in zip(got.logprobs, reference["forward"].logprobs):
                np.testing.assert_allclose(ours, theirs, atol=1e-5)
            sampled = decode("sample", SampleRequest("p", ["hi"], num_samples=2, sampling=SamplingParams(max_tokens=3), seed=1))
            assert len(sampled.sequences[0]) == 2
    finally:
        worker.close()


def test_a_second_policy_rebuilds_the_ranks_and_every_policy_keeps_its_state(tiny_model, sharded, reference):
    """FSDP2 shards the parameters a model has: a policy created later rebuilds each rank (full states out, the
    model loaded and sharded again, states back in); a reset goes back to the fresh init; a delete rebuilds."""
    other = LoraConfig(rank=8, alpha=16, seed=11)
    single = Worker(tiny_model, micro_batch_size=2)
    single.create_policy(CreatePolicyRequest("q", other))
    fresh_q = single.save_state(SaveStateRequest("q"))
    single.update(UpdateRequest("q", batch(1), LossConfig(), ADAM))
    assert sharded.create_policy(CreatePolicyRequest("q", other))["created"]
    assert sharded.policies["p"].version == 1  # "p" (trained above) came through the rebuild
    assert_same_state(sharded.save_state(SaveStateRequest("p")), reference["one"])
    assert sharded.update(UpdateRequest("q", batch(1), LossConfig(), ADAM)).policy_version == 1
    assert_same_state(sharded.save_state(SaveStateRequest("q")), single.save_state(SaveStateRequest("q")))
    assert sharded.reset_policy(ResetPolicyRequest("q")) == {"policy": "q", "policy_version": 0}
    reset = sharded.save_state(SaveStateRequest("q", include_optimizer=False))
    for key, value in weights(fresh_q).items():
        torch.testing.assert_close(weights(reset)[key], value)
    assert sharded.delete_policy(DeletePolicyRequest("q"))["deleted"] and set(sharded.policies) == {"p"}
    assert_same_state(sharded.save_state(SaveStateRequest("p")), reference["one"])


def assert_within_float_noise_of_adam(ours: torch.Tensor, theirs: torch.Tensor, lr: float, key: str) -> None:
    """Adam's first step moves a weight by lr * g / (|g| + eps): for the few gradients near eps (1e-8) a rounding
    difference of the ranks' other summation order is multiplied by ~lr / eps (measured: up to 2.5% of a step on
    single elements on an AMD EPYC, 0.6% elsewhere; ~1e-7 of a step on the rest). A real fault (a micro-batch lost or counted twice) moves every
    element by a sizeable share of a step."""
    assert float((ours - theirs).abs().max()) <= 0.05 * lr, key
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-3, key


def test_a_local_run_over_two_gpus_trains_as_one_process_does(tmp_path, tiny_model, monkeypatch):
    """`TrainConfig.gpus` (`tinkerless train --gpus N`, what the managed SkyPilot job passes on a node of N GPUs):
    the update trains over N ranks and this process samples from their adapter. On a CPU the ranks are gloo
    processes. Step 0 samples from the same fresh adapter, so its update must match a one-process run's to float
    tolerance; later steps sample from adapters that differ in the last bits, which may flip a near-tied token."""
    import tinkerless
    from tinkerless.functions.sharding import split

    made = []
    original = split.SplitWorker.__init__

    def recording(self, model, *, ranks, **options):
        made.append(ranks)
        original(self, model, ranks=ranks, **options)

    monkeypatch.setattr(split.SplitWorker, "__init__", recording)

    @tinkerless.reward
    def short(completion, task):
        return -len(completion) / 10

    lr = 3e-2

    def run(name: str, gpus: int):
        return tinkerless.train(model=tiny_model, reward=short, tasks=lambda rng: {"prompt": f"n {rng.randint(0, 9)}"},
                                steps=2, batch_size=2, group_size=4, max_tokens=6, temperature=1.0, learning_rate=lr,
                                checkpoint_every=1, seed=5, storage=str(tmp_path / name), progress=False, run_id="r",
                                threads=2, gpus=gpus)

    one, two = run("one", 1), run("two", 2)
    assert made == [2] and len(two.metrics) == 2
    first = [(e["messages"], e["reward"]) for e in map(json.loads, (tmp_path / "one/runs/r/episodes.jsonl").read_text().splitlines()) if e["step"] == 0]
    assert first == [(e["messages"], e["reward"]) for e in map(json.loads, (tmp_path / "two/runs/r/episodes.jsonl").read_text().splitlines()) if e["step"] == 0]
    assert two.metrics[0]["loss"] == pytest.approx(one.metrics[0]["loss"], rel=1e-5, abs=1e-7)
    adapter = "runs/r/checkpoints/step-1/adapter/adapter_model.safetensors"
    ours, theirs = (load_safetensors((tmp_path / name / adapter).read_bytes()) for name in ("two", "one"))
    for key in theirs:
        assert_within_float_noise_of_adam(ours[key], theirs[key], lr, key)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", 65])
def test_gpus_that_are_not_a_count_of_gpus_are_config_errors(bad):
    import tinkerless
    from tinkerless.errors import ConfigError

    with pytest.raises(ConfigError, match="gpus must be a whole number from 1 to 64"):
        tinkerless.TrainConfig(model="m", reward=lambda completion, task: 0.0, gpus=bad).validate()
    with pytest.raises(ConfigError, match="gpus is a setting of the local backend"):
        tinkerless.TrainConfig(model="m", reward=lambda completion, task: 0.0, gpus=2, backend="modal").validate()


def test_an_sft_run_over_two_gpus_trains_as_one_process_does(tmp_path, tiny_model):
    """`SFTConfig.gpus` (`tinkerless sft --gpus N`): the same sharded update under supervised training."""
    import tinkerless

    data = [{"messages": [{"role": "user", "content": f"n{i}"}, {"role": "assistant", "content": f"{i}{i}"}]}
            for i in range(8)]

    lr = 1e-2

    def run(name: str, gpus: int):
        return tinkerless.sft(model=tiny_model, data=data, steps=3, batch_size=4, learning_rate=lr, checkpoint_every=1,
                              eval_fraction=0.25, eval_every=1, run_id="s", progress=False, threads=2,
                              storage=str(tmp_path / name), gpus=gpus)

    one, two = run("one", 1), run("two", 2)
    for a, b in zip(one.metrics, two.metrics):
        assert b["train_nll"] == pytest.approx(a["train_nll"], rel=1e-4) and b["eval_nll"] == pytest.approx(a["eval_nll"], rel=1e-4)
    adapter = "runs/s/checkpoints/step-1/adapter/adapter_model.safetensors"
    ours, theirs = (load_safetensors((tmp_path / name / adapter).read_bytes()) for name in ("two", "one"))
    for key in theirs:
        assert_within_float_noise_of_adam(ours[key], theirs[key], lr, key)
