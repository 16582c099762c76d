"""Mixed-version rollouts on the controller's side: the ticks a request's tokens fall in
(`InFlightPlan`, a function of the config and the token count alone, never of timing), and
the job queue that decodes a tick's continuations with a batch's new requests, on the worker
that parked them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlax_tpu.config import load_config
from rlax_tpu.controller.workers import _STOP, Job, JobQueue
from rlax_tpu.staleness import InFlightPlan, StalenessPolicy

ROOT = Path(__file__).resolve().parents[1]


def plan(mode="resume", eta=1, n=3, tick_tokens=0, max_new=64, steps=10):
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    config = config.apply_overrides(
        (
            f"inference.in_flight_update={mode}",
            f"inference.tick_tokens={tick_tokens}",
            f"inference.max_new_tokens={max_new}",
            f"staleness.reload_every={eta}",
            f"staleness.max_staleness={n}",
            f"controller.num_steps={steps}",
            "trainer.max_seq_len=256",
        )
    )
    return InFlightPlan.of(config, StalenessPolicy(eta, n))


def test_off_and_a_bound_with_no_room_make_no_plan():
    assert plan("off") is None
    assert plan(n=1, eta=1) is None  # N - η = 0: no tick to carry a response into
    assert plan(n=2, eta=2) is None


@pytest.mark.parametrize(("eta", "n"), [(1, 2), (1, 3), (1, 5), (2, 3), (2, 5), (3, 7)])
def test_every_token_of_a_batch_lies_within_the_bound_and_before_the_batch(eta, n):
    p = plan(eta=eta, n=n, max_new=40, steps=30)
    policy = StalenessPolicy(eta, n)
    assert p.segments == n - eta and p.tick_tokens == -(-40 // (n - eta + 1))
    for batch in range(30):
        for tokens in range(40):
            tick = p.tick(batch, tokens)
            version = policy.scheduled_version(tick)
            assert tick < 30  # no tick after the run's last batch
            assert policy.is_acceptable(batch, version)
            # a version workers load today, and one the parameter server still holds for
            # every batch from `batch` on: the publish and retention rules are unchanged
            assert policy.is_loadable(version) and version >= policy.oldest_needed(batch)
            # ... and the tick that completes batch b needs no version newer than b - 1
            # (b - 1 trains meanwhile), except the run's first batches at version 0
            assert version <= max(0, batch - 1)
            # a call's budget ends where the next tick begins
            budget = p.budget(batch, tokens)
            if budget:
                assert p.tick(batch, tokens + budget) == tick + 1 or tokens % budget
            else:
                assert tick == batch + p.last_segment(batch)


def job(priority, version, worker=None, name="r"):
    requests = [type("R", (), {"request_id": f"{name}{priority}"})()]
    return Job((priority, 0), version, requests, lambda r: None, lambda e: None, worker=worker)


def test_a_worker_takes_its_kept_jobs_of_the_version_and_one_shared_one_together():
    queue = JobQueue(merge=True)
    for j in (job(1, 4), job(2, 4, worker=0), job(3, 4, worker=1), job(4, 4), job(5, 6, worker=0)):
        queue.put(j)
    taken = queue.take(0)
    assert taken.version == 4 and taken.worker == 0
    assert [r.request_id for r in taken.requests] == ["r1", "r2"]
    # worker 1 takes its own and the next shared one; version 6 waits for its tick
    assert [r.request_id for r in queue.take(1).requests] == ["r3", "r4"]
    assert [r.request_id for r in queue.take(0).requests] == ["r5"]


def test_a_job_kept_for_a_lost_worker_goes_to_any():
    queue = JobQueue(merge=True)
    queue.put(job(1, 4, worker=1))
    queue.down(1)
    queue.put(job(2, 4, worker=1))  # paused there before it was lost
    assert [queue.take(0).requests[0].request_id for _ in range(2)] == ["r1", "r2"]
    queue.down(1, False)
    queue.put(job(3, 4, worker=1))
    queue.put(_STOP)
    assert queue.take(0) is _STOP  # worker 0 may not take worker 1's job


def test_jobs_of_equal_priority_kept_for_two_workers_each_reach_their_own():
    """The continuations of one batch's tick, kept for workers 0 and 1, share a priority
    (jobs compare by it alone): each worker takes its own, none is lost or taken twice."""
    queue = JobQueue(merge=True)
    queue.put(job(1, 4, worker=1, name="w1-"))
    queue.put(job(1, 4, worker=0, name="w0-"))
    queue.put(_STOP)  # last: a worker finding nothing of its own takes it
    assert [r.request_id for r in queue.take(0).requests] == ["w0-1"]
    assert [r.request_id for r in queue.take(1).requests] == ["w1-1"]
    assert queue.take(0) is _STOP


def test_a_merged_job_hands_each_rollout_to_the_job_it_came_from():
    got: dict[str, list] = {"a": [], "b": []}
    paused: list = []

    def make(name, worker):
        requests = [type("R", (), {"request_id": f"{name}{k}"})() for k in range(2)]
        return Job(
            (0, 0),
            4,
            requests,
            lambda rs, name=name: got[name].extend(r.request_id for r in rs),
            lambda e: None,
            pause=lambda rs, w: paused.extend((r.request_id, w) for r in rs),
            worker=worker,
        )

    queue = JobQueue(merge=True)
    queue.put(make("a", None))
    queue.put(make("b", 1))
    merged = queue.take(1)
    rollout = lambda rid: type("Ro", (), {"request_id": rid})()  # noqa: E731
    merged.deliver([rollout("a0"), rollout("b1"), rollout("a1")])
    merged.pause([rollout("b0")], 1)
    assert got == {"a": ["a0", "a1"], "b": ["b1"]} and paused == [("b0", 1)]


def test_without_merging_the_queue_is_the_priority_queue_it_was():
    queue = JobQueue()
    for j in (job(3, 4), job(1, 6), job(2, 4)):
        queue.put(j)
    assert [queue.take(0).priority[0] for _ in range(3)] == [1, 2, 3]


def test_in_flight_updates_need_the_deterministic_schedule():
    config = load_config(str(ROOT / "configs" / "tiny_cpu.py"))
    with pytest.raises(Exception, match="needs staleness.schedule"):
        config.apply_overrides(("inference.in_flight_update=keep", "staleness.schedule=freshest"))
    assert dataclasses.replace(config).inference.in_flight_update == "off"
