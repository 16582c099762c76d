"""The optional inputs of the objective (issue 23) as the trainer prepares them: with a
rollout correction, π_old is the trainer's recompute and π_rollout the log-probs the batch
brought; fields only the sender can supply are refused when missing; the abstract batch
`rlax-tpu compile` lowers carries what the objective reads; the config refuses a rollout
correction over cached behaviour log-probs, and agrees with the objective on which configs
have one."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from trainer_helpers import rollout_batch, run_config

from rlax_tpu.algorithms import Objective, build_objective
from rlax_tpu.api.trainer import BatchFormatError
from rlax_tpu.config import AlgorithmConfig, ConfigError, KLConfig, MeshConfig
from rlax_tpu.config.run import needs_rollout_logprobs
from rlax_tpu.sharding import build_mesh, use_mesh
from rlax_tpu.trainer import Trainer
from rlax_tpu.trainer import programs as programs_module
from rlax_tpu.trainer.programs import TrainerPrograms

ONE_DEVICE = MeshConfig(data=1, fsdp=1, tensor=1)


def _mesh():
    return build_mesh(ONE_DEVICE, devices=jax.devices()[:1])


TIS = AlgorithmConfig(name="grpo", rollout_correction="token_tis", kl=KLConfig(beta=0.04))


class RecordingObjective(Objective):
    """The configured objective (with `needs` flags set on top), recording what the batch
    that reaches it holds (at trace time in Python, the values through a debug callback)."""

    seen: dict = {}

    def __init__(self, config, **needs):
        super().__init__(config)
        for name, value in needs.items():
            setattr(self, name, value)

    def __call__(self, batch, logprobs, **kw):
        seen = RecordingObjective.seen
        seen["rollout_is_none"] = batch.rollout_logprobs is None
        if batch.rollout_logprobs is not None:

            def record(rollout, behaviour):
                seen["rollout"] = np.asarray(rollout)
                seen["behaviour"] = np.asarray(behaviour)

            jax.debug.callback(record, batch.rollout_logprobs, batch.behaviour_logprobs)
        return super().__call__(batch, logprobs, **kw)


@pytest.fixture
def objective_needs(monkeypatch):
    """set(**flags): the trainers built afterwards use a RecordingObjective with `flags`."""
    RecordingObjective.seen = {}

    def set_flags(**flags):
        monkeypatch.setattr(
            programs_module, "build_objective", lambda c: RecordingObjective(c, **flags)
        )
        return RecordingObjective.seen

    return set_flags


def test_a_rollout_correction_gets_the_recompute_as_pi_old_and_the_sent_logprobs_as_rollout(
    tmp_path, objective_needs
):
    seen = objective_needs()
    # recompute_every=0: only the objective's need makes the recompute run, every step.
    config = run_config(str(tmp_path / "run"), mini=8, recompute_every=0, algorithm=TIS)
    trainer = Trainer(config, mesh=_mesh())
    assert trainer.objective.needs_rollout_logprobs
    trainer.initialize()
    for step in range(2):
        batch = rollout_batch(step)
        with use_mesh(trainer.mesh, trainer.rules):
            expected = trainer.programs.recompute(trainer._params, batch.tokens, False).logprobs
            expected = np.asarray(jax.device_get(expected))
        seen.pop("rollout", None)
        result = trainer.train_step(step, batch)
        assert seen["rollout_is_none"] is False
        np.testing.assert_array_equal(seen["rollout"], np.asarray(batch.behaviour_logprobs))
        np.testing.assert_allclose(seen["behaviour"], expected, rtol=1e-6, atol=1e-6)
        mask = np.asarray(batch.response_mask)
        # The two differ (the batch's fake μ is ~0.2 nats off): neither stands for the other.
        assert np.abs(seen["behaviour"] - seen["rollout"])[mask].mean() > 0.1
        assert "mismatch/recomputed_vs_cached_mean" in result.metrics
    trainer.close()


def test_without_a_rollout_correction_the_update_gets_no_rollout_logprobs(tmp_path):
    trainer = Trainer(run_config(str(tmp_path / "run"), mini=8), mesh=_mesh())
    trainer.initialize()
    seen = []

    def rl_step(params, opt_state, batch, step, behaviour):  # the update, not compiled
        seen.append(batch)
        return params, opt_state, {}

    trainer._rl_step = rl_step
    batch = rollout_batch(0).replace(rollout_logprobs=rollout_batch(1).behaviour_logprobs)
    trainer.train_step(0, batch)
    trainer.close()
    assert seen[0].rollout_logprobs is None and seen[0].behaviour_logprobs is not None


def test_a_field_the_objective_needs_that_the_batch_lacks_is_refused_naming_it(tmp_path):
    given = AlgorithmConfig(name="grpo", advantage="given", kl=KLConfig(beta=0.0))
    config = run_config(str(tmp_path / "run"), mini=8, algorithm=given)
    trainer = Trainer(config, mesh=_mesh())
    assert trainer.programs.inputs == {"token_advantages"}
    trainer.initialize()
    with pytest.raises(BatchFormatError, match="batch.token_advantages is missing") as info:
        trainer.train_step(0, rollout_batch(0))
    assert info.value.field == "batch.token_advantages"
    assert trainer.step == 0
    trainer.close()


def test_the_abstract_batch_carries_what_the_objective_reads(tmp_path):
    remax = dataclasses.replace(TIS, advantage="remax")
    config = run_config(str(tmp_path / "run"), mini=8, algorithm=remax)
    programs = TrainerPrograms(config, _mesh())
    assert programs.inputs == {"reference_logprobs", "rollout_logprobs", "baseline_rewards"}
    batch = programs.abstract_rollout_batch(16)
    assert batch.rollout_logprobs.shape == (8, 16)
    assert batch.baseline_rewards.shape == (8,)
    assert batch.token_rewards is None and batch.token_advantages is None
    assert batch.reference_logprobs is not None  # GRPO's KL reads π_ref
    with use_mesh(programs.mesh, programs.rules):
        programs.rl_step.lower(*programs.abstract_rl_step_args(16))  # lowers as it runs


@pytest.mark.parametrize(
    ("correction", "named"),
    [
        ({"rollout_correction": "token_tis"}, "trainer.algorithm.rollout_correction='token_tis'"),
        ({"rollout_is.gate_threshold": 2.0}, "trainer.algorithm.rollout_is.gate_threshold=2.0"),
    ],
)
def test_a_rollout_correction_over_cached_logprobs_is_a_config_error(tmp_path, correction, named):
    algorithm = AlgorithmConfig(name="grpo").updated(correction)
    config = run_config(str(tmp_path / "run"), mini=8, algorithm=algorithm)  # recomputed: fine
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(
            config, trainer=dataclasses.replace(config.trainer, behaviour_logprobs="cached")
        )
    assert info.value.field == "trainer.behaviour_logprobs"
    message = str(info.value)
    assert named in message and "the correction would be 1" in message
    assert "trainer.behaviour_logprobs=recomputed" in message
    cached = run_config(str(tmp_path / "run"), mini=8, behaviour_logprobs="cached")
    assert cached.trainer.behaviour_logprobs == "cached"  # without a correction: fine


@pytest.mark.parametrize("name", AlgorithmConfig.PRESET_NAMES)
def test_the_config_and_the_objective_agree_on_needing_rollout_logprobs(name):
    kinds = [{}]
    if AlgorithmConfig(name=name).is_policy_gradient:
        kinds += [{"rollout_correction": c} for c in AlgorithmConfig.ROLLOUT_CORRECTIONS]
        kinds += [{"rollout_is.gate_threshold": 1.5}]
    for kw in kinds:
        algorithm = AlgorithmConfig(name=name).updated(kw)
        assert needs_rollout_logprobs(algorithm) == (
            build_objective(algorithm).needs_rollout_logprobs
        ), (name, kw)


def test_the_trainer_refuses_cached_logprobs_for_an_objective_with_a_rollout_correction(
    tmp_path, objective_needs
):
    objective_needs(needs_rollout_logprobs=True)
    config = run_config(str(tmp_path / "run"), mini=8, behaviour_logprobs="cached")
    with pytest.raises(ConfigError, match="trainer.behaviour_logprobs: is 'cached'"):
        Trainer(config, mesh=_mesh())
