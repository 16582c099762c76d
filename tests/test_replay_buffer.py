"""The TBA replay buffer: sampling frequencies, caps, eviction, and its snapshot state."""

import math

import numpy as np
import pytest

from rlax_tpu.controller.replay import Entry, ReplayBuffer


def entry(prompt: str, sample: int, version: int = 0, reward: float = 0.0) -> Entry:
    return Entry(
        batch=version,
        prompt_key=f"b{version}:{prompt}",
        sample_index=sample,
        version=version,
        reward=reward,
        added_at=0,
    )


def buffer(**kw) -> ReplayBuffer:
    args = dict(per_prompt_cap=8, global_cap=1000, recency_prob=0.5, reward_temperature=1.0, seed=0)
    return ReplayBuffer(**{**args, **kw})


def fill(buf: ReplayBuffer, step: int, prompts, version: int = 0, rewards=None) -> None:
    rewards = rewards or {}
    buf.add(
        step,
        [(p, entry(p, i, version, rewards.get(p, 0.0))) for p in prompts for i in range(2)],
    )


def z_ok(count: int, n: int, p: float, z: float = 4.0) -> bool:
    return abs(count - n * p) <= z * math.sqrt(n * p * (1 - p)) + 1


def test_recent_prompts_are_chosen_with_probability_m():
    m = 0.3
    buf = buffer(recency_prob=m, reward_temperature=0.0)
    fill(buf, 0, [f"old{i}" for i in range(9)])
    fill(buf, 1, ["new"])
    assert buf.recent == ["new"]
    n = 4000
    hits = sum(buf.sample(1, 2)[0][0] == "new" for _ in range(n))
    # "new" comes from the recent branch (prob m) or from the uniform branch (prob 1/10).
    assert z_ok(hits, n, m + (1 - m) / 10)


def test_reward_weighting_is_a_softmax_of_mean_reward():
    temperature = 0.5
    buf = buffer(recency_prob=0.0, reward_temperature=temperature)
    rewards = {"a": 0.0, "b": 0.5, "c": 1.0}
    fill(buf, 0, list(rewards), rewards=rewards)
    logits = np.asarray(list(rewards.values())) / temperature
    expected = np.exp(logits) / np.exp(logits).sum()
    n = 6000
    counts = {k: 0 for k in rewards}
    for _ in range(n):
        counts[buf.sample(1, 1)[0][0]] += 1
    for k, p in zip(rewards, expected, strict=True):
        assert z_ok(counts[k], n, p), (k, counts[k], n * p)


def test_a_batch_has_distinct_prompts_and_k_responses_with_replacement_only_when_short():
    buf = buffer()
    buf.add(0, [("a", entry("a", i)) for i in range(5)] + [("b", entry("b", 0))])
    groups = dict(buf.sample(2, 3))
    assert set(groups) == {"a", "b"}
    assert len({e.key for e in groups["a"]}) == 3  # a has 5: no repeats
    assert [e.key for e in groups["b"]] == [entry("b", 0).key] * 3  # b has 1: repeated
    with pytest.raises(ValueError, match="fewer than"):
        buf.sample(3, 1)


def test_caps_evict_the_oldest_and_duplicates_are_ignored():
    buf = buffer(per_prompt_cap=3, global_cap=5)
    buf.add(0, [("a", entry("a", i)) for i in range(4)])
    assert [e.sample_index for e in buf.entries("a")] == [1, 2, 3]
    assert buf.add(1, [("a", entry("a", 3))]) == 0  # already seen
    buf.add(2, [("b", entry("b", i, version=2)) for i in range(3)])
    assert len(buf) == 5 and len(buf.entries("a")) == 2  # global cap: a's oldest went
    buf.add(3, [("c", entry("c", 0, version=3))])
    assert len(buf) == 5 and len(buf.entries("a")) == 1


def test_entries_too_stale_for_the_step_are_evicted_and_never_sampled():
    buf = buffer(recency_prob=0.0)
    fill(buf, 0, ["a", "b"], version=0)
    fill(buf, 3, ["b", "c"], version=3)
    assert buf.evict_older_than(2) == 4
    assert sorted(buf.prompts) == ["b", "c"]
    for _ in range(50):
        for _, entries in buf.sample(2, 2):
            assert all(e.version >= 2 for e in entries)


def test_state_round_trip_continues_the_same_sequence():
    a = buffer()
    fill(a, 0, [f"p{i}" for i in range(6)], rewards={"p1": 1.0})
    a.sample(2, 2)
    state = a.state()
    b = buffer(seed=99)  # a different seed: everything comes from the state
    b.restore(state)
    assert [[(u, [e.key for e in es]) for u, es in a.sample(3, 2)] for _ in range(5)] == [
        [(u, [e.key for e in es]) for u, es in b.sample(3, 2)] for _ in range(5)
    ]
    with pytest.raises(ValueError, match="malformed"):
        b.restore({"rng": state["rng"]})
