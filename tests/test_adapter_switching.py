"""The worker switches LoRA adapters only when another one is wanted, and never samples or trains with a stale one.

Switching (peft's set_adapter, or disabling every adapter for the base model) walks every module, so it
is skipped when the wanted adapter is active already; a decode step of the same policy switches nothing.
The class of bug this guards: a sample or a training step computed with another policy's adapter, or with
adapters switched off, because the worker believed the right one active: after sampling the base model,
after a training step, after a batch that mixed adapters, after a policy was created, reset, loaded or
deleted. Each sample is compared with what a fresh worker that only serves that policy draws.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tinkerless.functions.losses import LossConfig
from tinkerless.functions.worker import Worker
from tinkerless.server.scheduler import Scheduler
from tinkerless.wire.messages import (
    BASE_POLICY, AdamParams, CreatePolicyRequest, Datum, ForwardBackwardRequest, LoadStateRequest, LoraConfig,
    OptimStepRequest, PolicyState, ResetPolicyRequest, SamplingParams, SaveStateRequest,
)

PROMPTS = [[3, 4, 5], [7, 8]]
SAMPLING = SamplingParams(max_tokens=6, temperature=1.0, stop_token_ids=[])


def randomize(worker: Worker, name: str, seed: int) -> None:
    with torch.no_grad():  # visibly different policies, from each other and from the base model
        for p in worker.policies[name].params:
            torch.nn.init.normal_(p, std=0.2, generator=torch.Generator().manual_seed(seed))


def sample(worker: Worker, policy: str, seed: int) -> list[tuple[list[int], list[float]]]:
    return [(g.tokens, g.logprobs) for g in worker.engine.generate(PROMPTS, SAMPLING, policy=policy, seed=seed)]


class References:
    """Fresh workers, each serving one policy only (loaded with the policy's weights of the moment)."""

    def __init__(self, tiny_model, worker: Worker):
        self.tiny_model, self.worker, self.fresh = tiny_model, worker, {}

    def serving(self, policy: str) -> Worker:
        if policy not in self.fresh:
            self.fresh[policy] = Worker(self.tiny_model)
        fresh = self.fresh[policy]
        if policy != BASE_POLICY:
            fresh.load_state(LoadStateRequest(self.worker.save_state(SaveStateRequest(policy))))
        return fresh

    def check(self, got, policy: str, seed: int, abs_tol: float = 1e-5) -> None:
        want = sample(self.serving(policy), policy, seed)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want], f"{policy} sampled with another adapter"
        for (_, got_lp), (_, want_lp) in zip(got, want):
            assert got_lp == pytest.approx(want_lp, abs=abs_tol)


def update(worker: Worker, policy: str) -> float:
    tokens = np.array([3, 4, 5, 6, 7, 8], np.int32)
    datum = Datum(tokens, np.array([0, 0, 1, 1, 1, 1], np.float32))
    worker.forward_backward(ForwardBackwardRequest(policy, [datum], LossConfig("cross_entropy")))
    return worker.optim_step(OptimStepRequest(policy, AdamParams(learning_rate=1e-2))).metrics["grad_norm"]


def test_interleaved_policies_base_and_updates_each_sample_with_their_own_adapter(tiny_model):
    worker = Worker(tiny_model)
    refs = References(tiny_model, worker)
    for name, seed in (("pa", 1), ("pb", 2)):  # on some modules only: a later adapter wraps new ones
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4, seed=seed, target_modules=["q_proj", "v_proj"])))
        randomize(worker, name, seed)

    seed = 0
    def check(policy):
        nonlocal seed
        seed += 1
        refs.check(sample(worker, policy, seed), policy, seed)

    for policy in ("pa", BASE_POLICY, "pb", "pa", BASE_POLICY, BASE_POLICY, "pb"):
        check(policy)

    # A training step right after sampling the base model (every adapter off) trains pa, with pa's gradients.
    fresh = refs.serving("pa")  # pa's weights and optimizer state before the step
    assert update(worker, "pa") == pytest.approx(update(fresh, "pa"), rel=1e-5)
    check(BASE_POLICY)
    assert update(worker, "pb") > 0
    for policy in ("pa", "pb", BASE_POLICY, "pa"):
        check(policy)

    # A batch that mixes adapters right after a base-model forward (adapters off): each row its own adapter.
    check(BASE_POLICY)
    scheduler, gate = Scheduler(slice_seconds=0.05), threading.Event()
    batcher = worker.engine.batcher
    try:
        scheduler.submit(gate.wait, tenant="gate")  # holds the model until every request is queued
        futures = [scheduler.submit(lambda p=p, s=s: sample(worker, p, s), tenant=p)
                   for p, s in (("pa", 101), (BASE_POLICY, 102), ("pb", 103))]
        batcher.most_jobs = 0
        gate.set()
        mixed = [f.result(timeout=120) for f in futures]
    finally:
        scheduler.close()
    assert batcher.most_jobs == 3, "the requests were not decoded in one mixed-adapter forward"
    for got, (policy, s) in zip(mixed, (("pa", 101), (BASE_POLICY, 102), ("pb", 103))):
        refs.check(got, policy, s, abs_tol=1e-4)  # batched products: equal up to rounding
    for policy in ("pb", BASE_POLICY, "pa"):
        check(policy)

    # Policies created, reset, loaded and deleted between samples. pc wraps modules pa does not: those start
    # with pc active, so pa (active before) must be set again.
    worker.create_policy(CreatePolicyRequest("pc", LoraConfig(rank=4, seed=3)))
    randomize(worker, "pc", 3)
    for policy in ("pa", "pc", BASE_POLICY):
        check(policy)
    worker.reset_policy(ResetPolicyRequest("pb"))
    for policy in ("pb", "pa"):
        check(policy)
    worker.load_state(LoadStateRequest(PolicyState("pd", worker.save_state(SaveStateRequest("pa")).files, 0)))
    for policy in ("pd", BASE_POLICY, "pb"):
        check(policy)
    check(BASE_POLICY)
    assert worker.drop_policy("pc")
    for policy in ("pa", BASE_POLICY, "pd"):
        check(policy)


def test_a_generation_switches_adapters_once_not_at_every_step(tiny_model):
    worker = Worker(tiny_model)
    for name in ("pa", "pb"):
        worker.create_policy(CreatePolicyRequest(name, LoraConfig(rank=4)))
    switches = []
    peft_model = worker.model
    for method in ("set_adapter", "disable_adapter_layers", "enable_adapter_layers"):
        owner = peft_model if method == "set_adapter" else peft_model.base_model
        real = getattr(owner, method)
        setattr(owner, method, lambda *a, real=real, method=method, **k: (switches.append(method), real(*a, **k))[1])
    long = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=[])
    for policy, expected in (("pa", 2), ("pa", 0), (BASE_POLICY, 1), (BASE_POLICY, 0), ("pb", 2)):
        switches.clear()
        worker.engine.generate(PROMPTS, long, policy=policy, seed=0)  # 12 forwards
        # From an unknown or the base state: enable + set_adapter; to the base model: one disable.
        assert len(switches) == expected, (policy, switches)
