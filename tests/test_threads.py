"""The worker's CPU thread count: explicit setting, OMP_NUM_THREADS, else the free usable cores."""

from __future__ import annotations

import os

import pytest
import torch

from tinkerless.errors import ConfigError
from tinkerless.functions import threads
from tinkerless.functions.threads import choose_threads, usable_cpus
from tinkerless.sdk.config import TrainConfig


def test_explicit_setting_wins_over_everything():
    choice = choose_threads(3, environ={"OMP_NUM_THREADS": "8"}, load=100.0)
    assert choice.threads == 3 and choice.reason == "threads setting"


def test_omp_num_threads_is_respected():
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "1"}, load=0.0).threads == 1
    assert choose_threads(None, environ={"OMP_NUM_THREADS": "4,2"}, load=0.0).threads == 4  # nested levels: the first


@pytest.mark.parametrize("bad", ["0", "-1", "many", "1.5"])
def test_a_bad_omp_num_threads_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="OMP_NUM_THREADS"):
        choose_threads(None, environ={"OMP_NUM_THREADS": bad})


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_a_bad_threads_setting_is_a_config_error(bad):
    with pytest.raises(ConfigError, match="threads must be"):
        choose_threads(bad)


def test_the_default_counts_usable_cores_and_leaves_busy_ones(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    assert choose_threads(None, environ={}, load=0.0).threads == 8
    assert choose_threads(None, environ={}, load=2.6).threads == 5  # about 3 cores busy with other work
    assert choose_threads(None, environ={}, load=50.0).threads == 1  # never fewer than one


def test_usable_cpus_follows_the_affinity_mask():
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


def test_usable_cpus_is_capped_by_a_cgroup_quota(monkeypatch):
    monkeypatch.setattr(threads, "_cgroup_cpu_limit", lambda: 1)
    assert usable_cpus() == 1


def test_the_worker_applies_its_choice(tiny_model):
    from tinkerless.functions.worker import Worker

    before = torch.get_num_threads()
    try:
        worker = Worker(tiny_model, threads=1)
        assert torch.get_num_threads() == 1 and worker.info()["threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_train_config_validates_threads():
    TrainConfig(reward=lambda c, t: 0.0, tasks=[{"prompt": "x"}], threads=2).validate()
    with pytest.raises(ConfigError, match="threads must be at least 1"):
        TrainConfig(reward=lambda c, t: 0.0, tasks=[{"prompt": "x"}], threads=0).validate()
