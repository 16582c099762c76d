"""The staleness policy: the schedule's invariants over all valid (η, N, b), and its rules."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_tpu.config import ConfigError, StalenessConfig
from rlax_tpu.staleness import StalenessPolicy


@st.composite
def policies(draw, schedule="deterministic"):
    eta = draw(st.integers(1, 64))
    n = draw(st.integers(eta - 1, eta - 1 + 128))
    return StalenessPolicy(eta, n, schedule)


@given(policy=policies(), batch=st.integers(0, 10_000))
def test_schedule_invariants(policy, batch):
    g = policy.scheduled_version(batch)
    assert batch - g <= policy.max_staleness  # acceptable when trained
    assert g % policy.reload_every == 0  # loadable by workers
    assert 0 <= g <= batch  # never from the future
    assert policy.scheduled_version(batch + 1) >= g  # non-decreasing
    assert policy.is_acceptable(batch, g) and policy.is_loadable(g)


@given(policy=policies(), batch=st.integers(0, 10_000))
def test_scheduled_version_is_the_oldest_loadable_acceptable_version(policy, batch):
    g = policy.scheduled_version(batch)
    older = g - policy.reload_every
    assert older < 0 or not policy.is_acceptable(batch, older)


@given(policy=policies(), step=st.integers(0, 10_000), later=st.integers(0, 500))
def test_no_batch_from_step_on_needs_a_version_older_than_oldest_needed(policy, step, later):
    oldest = policy.oldest_needed(step)
    batch = step + later
    assert policy.scheduled_version(batch) >= oldest
    # Under the freshest schedule too: whatever it picks is >= oldest_needed.
    fresh = StalenessPolicy(policy.reload_every, policy.max_staleness, "freshest")
    chosen = fresh.generation_version(batch, newest_published=batch)
    assert chosen is not None and chosen >= oldest


@pytest.mark.parametrize(
    "eta, n, expected",
    [
        (1, 0, [0, 1, 2, 3, 4, 5, 6]),  # on-policy: lockstep
        (1, 1, [0, 0, 1, 2, 3, 4, 5]),  # one-step off-policy
        (4, 3, [0, 0, 0, 0, 4, 4, 4]),
        (2, 4, [0, 0, 0, 0, 0, 2, 2]),
    ],
)
def test_schedule_examples(eta, n, expected):
    policy = StalenessPolicy(eta, n)
    assert [policy.scheduled_version(b) for b in range(7)] == expected


def test_deterministic_schedule_waits_for_its_version():
    policy = StalenessPolicy(2, 3)
    assert policy.generation_version(7, newest_published=3) is None  # needs g(7) = 4
    assert policy.generation_version(7, newest_published=6) == 4  # not fresher


def test_freshest_schedule_takes_the_newest_loadable_version():
    policy = StalenessPolicy(2, 3, "freshest")
    assert policy.generation_version(7, newest_published=7) == 6
    assert policy.generation_version(7, newest_published=3) is None  # 2 is too stale for 7


def test_acceptance_rejects_stale_and_future_rollouts():
    policy = StalenessPolicy(1, 2)
    assert policy.is_acceptable(5, 3)
    assert not policy.is_acceptable(5, 2)  # 3 versions old
    assert not policy.is_acceptable(5, 6)  # from the future


@pytest.mark.parametrize(
    "eta, n, words",
    [(0, 0, "η must be >= 1"), (1, -1, "N must be >= 0"), (8, 3, "set max_staleness >= 7")],
)
def test_invalid_knobs_are_rejected_with_the_fix(eta, n, words):
    with pytest.raises(ConfigError, match=words):
        StalenessPolicy(eta, n)


def test_policy_from_config():
    policy = StalenessPolicy.from_config(StalenessConfig.PRESETS["off_policy"]())
    assert (policy.reload_every, policy.max_staleness) == (16, 32)


# -- what the trainer publishes -------------------------------------------------------------------
@settings(deadline=None, max_examples=60)
@given(
    policy=policies(),
    num_steps=st.integers(1, 200),
    schedule=st.sampled_from(["deterministic", "freshest"]),
    resume=st.integers(0, 200),
)
def test_every_version_read_is_published_and_nothing_else(policy, num_steps, schedule, resume):
    """Generation (either schedule, whatever the trainer has reached), evaluation at any
    step and a resume from any checkpoint read only published versions; the published
    ones are exactly the loadable versions and the final one."""
    policy = StalenessPolicy(policy.reload_every, policy.max_staleness, schedule)
    published = set(policy.published(0, num_steps, num_steps))
    assert published == {v for v in range(num_steps + 1) if policy.is_loadable(v)} | {num_steps}
    for batch in range(num_steps):
        for trainer_at in range(max(0, batch - policy.max_staleness), batch + 1):
            newest = trainer_at - trainer_at % policy.reload_every  # newest published then
            version = policy.generation_version(batch, newest)
            assert version is None or version in published, (batch, trainer_at, version)
        assert policy.scheduled_version(batch) in published
    for step in range(num_steps + 1):  # evaluation at step s measures s - s % η
        assert step - step % policy.reload_every in published
    checkpoint = min(resume, num_steps)  # a resume generates with [oldest_needed(c), c]
    needed = policy.published(policy.oldest_needed(checkpoint), checkpoint, num_steps)
    for batch in range(checkpoint, num_steps):
        assert policy.scheduled_version(batch) in set(needed) | published
        assert policy.scheduled_version(batch) >= policy.oldest_needed(checkpoint)


@given(policy=policies(), step=st.integers(0, 10_000))
def test_hot_versions_hold_what_a_batch_may_still_read_plus_the_next(policy, step):
    readable = [v for v in range(policy.oldest_needed(step), step + 1) if policy.is_loadable(v)]
    assert len(readable) + 1 <= policy.hot_versions()
