"""On a GPU, the activation budget of an update's micro-batches comes from the memory free to this process
(issue #25: an RL step that fits a 24 GB card). The CUDA queries are stubbed with what a card would answer;
the arithmetic and the choice between free memory and a per-process cap are the code's own."""

from __future__ import annotations

import pytest
import torch

from tinkerless.functions.training import micro_batches
from tinkerless.functions.training.micro_batches import GPU_FREE_SHARE, MIN_ACTIVATION_MB, activation_budget_bytes

GiB = 2**30


@pytest.fixture
def card(monkeypatch):
    state = {"total": 80 * GiB, "free": 60 * GiB, "fraction": 1.0, "reserved": 10 * GiB, "allocated": 8 * GiB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: state["fraction"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.delenv(micro_batches.ACTIVATION_ENV, raising=False)
    return state


def test_a_card_with_room_gets_the_default_ceiling(card):
    card.update(total=400 * GiB, free=380 * GiB)
    assert activation_budget_bytes("cuda") == micro_batches.DEFAULT_ACTIVATION_MB["cuda"] * 2**20


def test_the_budget_follows_free_memory_and_a_per_process_cap(card):
    card["free"] = 10 * GiB  # another process holds most of the card
    assert activation_budget_bytes("cuda") == int(GPU_FREE_SHARE * (10 * GiB + 2 * GiB))
    card.update(free=60 * GiB, fraction=0.3)  # set_per_process_memory_fraction(0.3): 24 GB of 80
    assert activation_budget_bytes("cuda") == int(GPU_FREE_SHARE * (24 * GiB - 8 * GiB))
    card.update(fraction=0.1)  # the weights alone nearly fill the cap: a floor, and layers recompute
    assert activation_budget_bytes("cuda") == MIN_ACTIVATION_MB * 2**20


def test_the_environment_still_decides_when_set(card, monkeypatch):
    monkeypatch.setenv(micro_batches.ACTIVATION_ENV, "300")
    assert activation_budget_bytes("cuda") == 300 * 2**20
    assert activation_budget_bytes("cpu") == 300 * 2**20
