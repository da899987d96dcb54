"""The server's scheduler: per-stream sequence order, round-robin tenants, back-pressure, gap skipping."""

from __future__ import annotations

import threading

import pytest

from tinkerless.server.scheduler import QueueFull, Scheduler


def gate_scheduler(**options):
    """A scheduler whose executor is parked on a first job until `release` is set, so tests can queue up work."""
    scheduler = Scheduler(**options)
    release = threading.Event()
    started = threading.Event()

    def blocker():
        started.set()
        release.wait(10)

    scheduler.submit(blocker, tenant="gate")
    assert started.wait(5)
    return scheduler, release


def test_jobs_of_one_stream_run_in_sequence_order_whatever_order_they_arrive_in():
    scheduler, release = gate_scheduler()
    ran: list[int] = []
    futures = [scheduler.submit(lambda s=s: ran.append(s) or s, tenant="a", stream="m1", seq=s) for s in (3, 1, 4, 2)]
    release.set()
    assert [f.result(5) for f in futures] == [3, 1, 4, 2]
    assert ran == [1, 2, 3, 4]
    scheduler.close()


def test_a_job_waits_for_its_predecessor_to_arrive():
    scheduler = Scheduler()
    second = scheduler.submit(lambda: "second", tenant="a", stream="m", seq=2)
    with pytest.raises(TimeoutError):
        second.result(0.3)  # seq 1 has not arrived: seq 2 must not run
    first = scheduler.submit(lambda: "first", tenant="a", stream="m", seq=1)
    assert first.result(5) == "first" and second.result(5) == "second"
    scheduler.close()


def test_tenants_take_turns():
    scheduler, release = gate_scheduler()
    ran: list[str] = []
    jobs = [scheduler.submit(lambda n=n: ran.append(n), tenant="alice") for n in ("a1", "a2", "a3")]
    jobs += [scheduler.submit(lambda n=n: ran.append(n), tenant="bob") for n in ("b1", "b2")]
    release.set()
    for job in jobs:
        job.result(5)
    # alice queued three before bob's first, yet bob's calls interleave instead of waiting behind all of hers.
    assert ran == ["a1", "b1", "a2", "b2", "a3"]
    scheduler.close()


def test_a_full_queue_refuses_with_a_retry_delay_and_recovers():
    scheduler, release = gate_scheduler(max_pending=2)
    accepted = [scheduler.submit(lambda: 1, tenant="a"), scheduler.submit(lambda: 2, tenant="a")]
    with pytest.raises(QueueFull) as full:
        scheduler.submit(lambda: 3, tenant="a")
    assert full.value.pending == 2 and 1.0 <= full.value.retry_after <= 30.0
    release.set()
    assert [f.result(5) for f in accepted] == [1, 2]
    assert scheduler.submit(lambda: 4, tenant="a").result(5) == 4  # room again
    scheduler.close()


def test_exceptions_reach_the_caller_and_the_stream_moves_on():
    scheduler = Scheduler()

    def boom():
        raise ValueError("bad datum")

    failed = scheduler.submit(boom, tenant="a", stream="m", seq=1)
    after = scheduler.submit(lambda: "ok", tenant="a", stream="m", seq=2)
    with pytest.raises(ValueError, match="bad datum"):
        failed.result(5)
    assert after.result(5) == "ok"
    scheduler.close()


def test_a_reused_sequence_number_is_refused():
    scheduler = Scheduler()
    assert scheduler.submit(lambda: 1, tenant="a", stream="m", seq=1).result(5) == 1
    with pytest.raises(ValueError, match="already used"):
        scheduler.submit(lambda: 1, tenant="a", stream="m", seq=1).result(5)
    scheduler.close()


def test_a_stream_stuck_on_a_gap_skips_ahead_after_the_timeout():
    scheduler = Scheduler(gap_timeout=0.2)
    later = scheduler.submit(lambda: "later", tenant="a", stream="m", seq=2)  # seq 1 never comes
    assert later.result(5) == "later"
    scheduler.close()


def test_streams_are_per_tenant():
    scheduler = Scheduler()
    # Both tenants use stream "m" from seq 1: neither waits for, or collides with, the other.
    assert scheduler.submit(lambda: "a", tenant="a", stream="m", seq=1).result(5) == "a"
    assert scheduler.submit(lambda: "b", tenant="b", stream="m", seq=1).result(5) == "b"
    scheduler.close()


def test_a_skipped_sequence_number_lets_the_stream_continue():
    scheduler = Scheduler()
    later = scheduler.submit(lambda: "second", tenant="a", stream="m", seq=2)
    scheduler.skip("a", "m", 1)  # call #1 was refused at the door (e.g. 413): #2 need not wait for it
    assert later.result(5) == "second"
    scheduler.close()
