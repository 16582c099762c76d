"""AlgorithmConfig: presets, overrides, validation messages, and agreement of its
JAX-free name tuples with the JAX registries."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlax_tpu import algorithms
from rlax_tpu.algorithms import describe, presets
from rlax_tpu.cli import main as cli_main
from rlax_tpu.config import (
    AlgorithmConfig,
    ClipConfig,
    ConfigError,
    ConfigRenamedWarning,
    ImportanceConfig,
    KLConfig,
    RunConfig,
)
from rlax_tpu.config.algorithm import RENAMED_ALGORITHM_FIELDS
from rlax_tpu.config.run import RENAMED_FIELDS

ROOT = Path(__file__).resolve().parents[1]


def test_config_names_agree_with_the_jax_registries():
    assert tuple(algorithms.AGGREGATIONS) == AlgorithmConfig.AGGREGATIONS
    assert tuple(algorithms.IMPORTANCE_WEIGHTS) == AlgorithmConfig.IMPORTANCE_WEIGHTS
    assert tuple(algorithms.ADVANTAGES) == AlgorithmConfig.ADVANTAGES
    assert tuple(algorithms.GRADIENT_MASKS) == AlgorithmConfig.GRADIENT_MASKS
    assert tuple(algorithms.KL_ESTIMATORS) == AlgorithmConfig.KL_ESTIMATORS
    assert tuple(algorithms.ROLLOUT_CORRECTIONS) == AlgorithmConfig.ROLLOUT_CORRECTIONS
    assert tuple(algorithms.COVARIANCE_CONTROLS) == AlgorithmConfig.COVARIANCE_CONTROLS
    assert tuple(algorithms.PRESETS) == AlgorithmConfig.PRESET_NAMES
    assert set(AlgorithmConfig.PRESETS) == set(AlgorithmConfig.PRESET_NAMES)


def test_config_package_does_not_import_jax():
    code = (
        "import sys; from rlax_tpu.config import AlgorithmConfig; "
        "AlgorithmConfig(name='dapo').resolved(); assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# The resolved parts of every preset: a changed default shows up here in review.
PINNED = {
    "reinforce": "reinforce: w=sequence_sum ρ=one A=reward M=keep_all R=none",
    "rloo": "rloo: w=sequence_sum ρ=one A=leave_one_out M=keep_all R=none",
    "proximal_rloo": "proximal_rloo: w=sequence_sum ρ=sequence[product] A=leave_one_out "
    "M=sequence_clip(ε_low=0.2, ε_high=0.2) R=none",
    "grpo": "grpo: w=sequence_mean ρ=token A=group_mean_std M=ppo_clip(ε_low=0.2, ε_high=0.2) "
    "R=0.04·k3",
    "dapo": "dapo: w=group_token_mean ρ=token A=group_mean_std "
    "M=ppo_clip(ε_low=0.2, ε_high=0.28) R=none",
    "dr_grpo": "dr_grpo: w=max_length ρ=token A=group_mean M=ppo_clip(ε_low=0.2, ε_high=0.2) "
    "R=none",
    "gspo": "gspo: w=sequence_mean ρ=sequence[geometric_mean] A=group_mean_std "
    "M=sequence_clip(ε_low=0.0003, ε_high=0.0004) R=none",
    "cispo": "cispo: w=group_token_mean ρ=token_clipped(ρ∈[0.0, 8.0]) A=group_mean_std "
    "M=keep_all R=none",
    "reinforce_pp": "reinforce_pp: w=sequence_mean ρ=token A=group_mean_batch_norm "
    "M=ppo_clip(ε_low=0.2, ε_high=0.2) R=0.001·k2",
    "reinforce_pp_batch": "reinforce_pp_batch: w=sequence_mean ρ=token A=batch_norm "
    "M=ppo_clip(ε_low=0.2, ε_high=0.2) R=0.01·k2",
    "reinforce_pp_return_to_go": "reinforce_pp_return_to_go: w=sequence_mean ρ=token "
    "A=reinforce_pp_return_to_go M=ppo_clip(ε_low=0.2, ε_high=0.2) R=0.01·k1 in the reward",
    "ppo": "ppo: w=token_mean ρ=token A=gae[whitened] M=ppo_clip(ε_low=0.2, ε_high=0.2) R=none",
    "aipo": "aipo: w=sequence_sum ρ=token_truncated(ρ_max=2.0) A=group_mean M=keep_all R=none",
    "remax": "remax: w=token_mean ρ=token A=remax M=ppo_clip(ε_low=0.2, ε_high=0.2) "
    "R=0.001·k1 in the reward",
    "opo": "opo: w=token_mean ρ=token A=opo M=ppo_clip(ε_low=0.2, ε_high=0.2) R=none",
    "gpg": "gpg: w=token_mean ρ=one A=gpg M=keep_all R=none",
    "grpo_dual_clip": "grpo_dual_clip: w=sequence_mean ρ=token A=group_mean_std "
    "M=ppo_clip(ε_low=0.2, ε_high=0.2)+dual_clip(c=3.0) R=0.04·k3",
    "clip_cov": "clip_cov: w=token_mean ρ=token A=group_mean_std "
    "M=ppo_clip(ε_low=1.0, ε_high=1.0) R=none cov=clip_cov(ratio=0.0002, cov∈(1.0, 5.0))",
    "kl_cov": "kl_cov: w=token_mean ρ=token A=group_mean_std M=keep_all R=none "
    "cov=kl_cov(ratio=0.002, κ=1.0)",
    "gmpo": "gmpo: w=sequence_mean ρ=sequence[geometric_mean] A=group_mean_std "
    "M=sequence_log_clip(ε_low=0.4, ε_high=0.4) R=none",
    "sapo": "sapo: w=sequence_mean ρ=token A=group_mean_std "
    "M=token_soft_gate(τ_pos=1.0, τ_neg=1.05) R=none",
    "trajectory_balance": "trajectory_balance: β=0.012→0.004 by step 500, reference reset never",
    "online_dpo": "online_dpo: β=0.1, reference reset never",
}


@pytest.mark.parametrize("name", AlgorithmConfig.PRESET_NAMES)
def test_a_preset_name_alone_gives_the_papers_configuration(name):
    config = AlgorithmConfig(name=name)
    assert describe(config) == PINNED[name]
    assert (
        presets.PRESETS[name]() == config.resolved() == AlgorithmConfig.PRESETS[name]().resolved()
    )
    doc = presets.PRESETS[name].__doc__
    assert any(f in doc for f in ("J =", "L =", "g =")) and re.search(
        r"et al\. (19|20)\d\d|\b1992", doc
    )


def test_ppo_preset_has_gae_and_value_head_settings():
    ppo = AlgorithmConfig.preset("ppo")
    assert (
        ppo.advantage_options.gae_gamma,
        ppo.advantage_options.gae_lambda,
        ppo.value.loss_coef,
        ppo.value.clip_eps,
    ) == (
        1.0,
        0.95,
        0.1,
        0.2,
    )


def test_explicit_fields_override_the_preset():
    config = AlgorithmConfig(name="grpo", clip=ClipConfig(eps_high=0.28)).resolved()
    assert (config.clip.eps_low, config.clip.eps_high, config.kl.beta) == (0.2, 0.28, 0.04)
    assert AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.0)).resolved().kl.beta == 0.0


def test_section_preset_and_name_overrides_from_the_command_line():
    run = RunConfig().apply_overrides(["trainer.algorithm=dapo"])
    assert run.trainer.algorithm == AlgorithmConfig(name="dapo")
    run = RunConfig().apply_overrides(
        ["trainer.algorithm.clip.eps_high=0.001", "trainer.algorithm.name=gspo"]
    )
    resolved = run.trainer.algorithm.resolved()
    assert (resolved.importance_weight, resolved.clip.eps_high) == ("sequence", 0.001)
    run = RunConfig().apply_overrides(["trainer.algorithm.gradient_mask=keep_all"])
    assert run.trainer.algorithm.resolved().gradient_mask == "keep_all"
    # "none" is the preset's value for a number, never a part name.
    run = RunConfig().apply_overrides(["trainer.algorithm.kl.beta=none"])
    assert run.trainer.algorithm.resolved().kl.beta == 0.04


def test_round_trips_through_dict():
    config = AlgorithmConfig(name="cispo", importance=ImportanceConfig(rho_max=5.0))
    assert AlgorithmConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "field, value, choices",
    [
        ("name", "ppo2", "reinforce, rloo, proximal_rloo, grpo, dapo"),
        ("aggregation", "mean", "sequence_mean, token_mean, group_token_mean, max_length"),
        ("importance_weight", "ratio", "one, token, token_truncated, token_clipped, sequence"),
        ("advantage", "grpo", "group_mean_std, group_mean, leave_one_out, batch_norm"),
        ("gradient_mask", "none", "keep_all, ppo_clip, sequence_clip"),
        ("sequence_ratio", "mean", "geometric_mean, product"),
        ("kl_estimator", "k4", "k1, k2, k3, abs"),
        ("rollout_correction", "tis", "none, token_tis, sequence_tis, token_mis, sequence_mis"),
        ("covariance_control", "cov", "none, clip_cov, kl_cov"),
    ],
)
def test_unknown_part_name_lists_the_valid_choices(field, value, choices):
    with pytest.raises(ConfigError, match=f"AlgorithmConfig.{field}: .*{value!r}") as info:
        AlgorithmConfig(**{field: value})
    assert choices in str(info.value)


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (
            {"name": "rloo", "gradient_mask": "ppo_clip"},
            "gradient_mask",
            "importance_weight='one' forms none; choose a ratio weight (token,",
        ),
        (
            {"name": "grpo", "gradient_mask": "sequence_clip"},
            "gradient_mask",
            "use gradient_mask='ppo_clip'",
        ),
        (
            {"name": "gspo", "gradient_mask": "ppo_clip"},
            "gradient_mask",
            "use gradient_mask='sequence_clip'",
        ),
        (
            {"name": "trajectory_balance", "aggregation": "token_mean"},
            "aggregation",
            "not used by trajectory_balance",
        ),
        (
            {"name": "online_dpo", "clip": {"eps_high": 0.3}},
            "clip.eps_high",
            "not used by online_dpo",
        ),
        (
            {"name": "online_dpo", "kl": {"reference_reset_every": 50}},
            "kl.reference_reset_every",
            "frozen",
        ),
        ({"name": "trajectory_balance", "kl": {"beta": 0.0}}, "kl.beta", "needs β > 0"),
        ({"name": "grpo", "clip": {"eps_low": 1.5}}, "clip.eps_low", "[0, 1]"),
        ({"name": "cispo", "importance": {"rho_max": 0.5}}, "importance.rho_max", ">= 1"),
        (
            {"name": "ppo", "advantage_options": {"gae_lambda": 1.5}},
            "advantage_options.gae_lambda",
            "[0, 1]",
        ),
        ({"name": "grpo", "kl": {"beta": -0.1}}, "kl.beta", ">= 0"),
    ],
)
def test_incompatible_combinations_fail_with_the_fix(kwargs, field, words):
    """The error names the field by its path in trainer.algorithm (a part's knob by its
    section: kl.beta)."""
    with pytest.raises(ConfigError) as info:
        AlgorithmConfig.from_dict(kwargs)
    assert info.value.field == field
    assert words in str(info.value)


def test_override_error_names_the_dotted_field():
    with pytest.raises(ConfigError, match=r"^trainer.algorithm.advantage: unknown advantage"):
        RunConfig().apply_overrides(["trainer.algorithm.advantage=vtrace"])


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.algorithm=ppo"],
        ["trainer.algorithm.advantage=gae"],  # GRPO with a GAE advantage, no value loss
    ],
)
def test_a_critic_without_a_value_head_names_both_fields_and_the_fix(overrides):
    with pytest.raises(ConfigError) as info:
        RunConfig().apply_overrides(overrides)
    assert info.value.field == "model.value_head"
    message = str(info.value)
    assert "trainer.algorithm.advantage='gae'" in message
    assert "trainer.algorithm.value.loss_coef" in message
    assert "set model.value_head=true" in message


def test_a_critic_with_a_value_head_is_accepted():
    run = RunConfig().apply_overrides(["model.value_head=true", "trainer.algorithm=ppo"])
    assert run.trainer.algorithm.resolved().advantage == "gae"
    # Without a critic, no value head is needed (and TB/DPO have no advantage at all).
    for name in ("grpo", "trajectory_balance", "online_dpo"):
        assert not RunConfig().apply_overrides([f"trainer.algorithm={name}"]).model.value_head


# -- each part's knobs in its section (issue 39) ------------------------------------------------
def test_a_section_left_partly_unset_takes_the_rest_from_the_preset():
    config = AlgorithmConfig(name="grpo", kl=KLConfig(beta=0.1)).resolved()
    assert config.kl.beta == 0.1  # set
    assert config.kl.beta_final == 0.04  # the grpo preset's
    assert config.clip == ClipConfig(eps_low=0.2, eps_high=0.2, dual_c=0.0)


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("kl_beta", "kl.beta", "0.1"),
        ("log_reference_kl", "kl.log_reference", "true"),
        ("clip_eps_high", "clip.eps_high", "0.28"),
        ("dual_clip_c", "clip.dual_c", "3.0"),
        ("rho_max", "importance.rho_max", "4.0"),
        ("whiten_advantages", "advantage_options.whiten", "true"),
        ("rollout_gate_threshold", "rollout_is.gate_threshold", "2.0"),
        ("cov_kl_coef", "covariance.kl_coef", "0.5"),
        ("soft_gate_tau_neg", "soft_gate.tau_neg", "1.2"),
        ("value_loss_coef", "value.loss_coef", "0.0"),
    ],
)
def test_an_old_algorithm_path_sets_its_section_field_with_a_warning(old, new, value):
    warned = re.escape(f"is now trainer.algorithm.{new}")
    with pytest.warns(ConfigRenamedWarning, match=warned):
        config = RunConfig().apply_overrides([f"trainer.algorithm.{old}={value}"])
    assert config == RunConfig().apply_overrides([f"trainer.algorithm.{new}={value}"])


def test_every_moved_algorithm_field_is_in_the_run_rename_table():
    for old, new in RENAMED_ALGORITHM_FIELDS.items():
        assert RENAMED_FIELDS[f"trainer.algorithm.{old}"] == f"trainer.algorithm.{new}"


def test_a_config_dict_with_flat_algorithm_fields_loads_as_the_same_run():
    """An older run's config.json (flat kl_beta, clip_eps_high, ...) loads into the sections,
    and its digest is the one of the same values written nested."""
    new = RunConfig().apply_overrides(
        ["trainer.algorithm.kl.beta=0.1", "trainer.algorithm.clip.eps_high=0.3"]
    )
    data = new.to_dict()
    algorithm = data["trainer"]["algorithm"]
    kl, clip = algorithm.pop("kl"), algorithm.pop("clip")
    algorithm.update(kl_beta=kl["beta"], log_reference_kl=kl["log_reference"])
    algorithm["clip_eps_high"] = clip["eps_high"]
    with pytest.warns(
        ConfigRenamedWarning, match="trainer.algorithm.kl_beta -> trainer.algorithm.kl.beta"
    ):
        old = RunConfig.from_dict(data)
    assert old == new and old.digest() == new.digest()
    assert "kl_beta" in new.identity()["trainer"]["algorithm"]  # the digest's form is flat


def test_an_algorithm_config_of_its_own_reads_its_old_flat_names():
    with pytest.warns(ConfigRenamedWarning, match="kl_beta -> kl.beta"):
        config = AlgorithmConfig.from_dict({"name": "grpo", "kl_beta": 0.2})
    assert config.kl.beta == 0.2


def test_a_plugin_preset_takes_sections_dicts_or_the_old_flat_names():
    """In a subprocess: a registered preset stays registered."""
    code = textwrap.dedent(
        """
        import dataclasses, warnings
        from rlax_tpu.config import AlgorithmConfig, ConfigRenamedWarning, KLConfig
        register = AlgorithmConfig.register_preset
        by_section = register("mine_a", base="grpo", values={"kl": KLConfig(beta=0.2)})
        by_dict = register("mine_b", base="grpo", values={"kl": {"beta": 0.2}})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            by_name = register("mine_c", base="grpo", values={"kl_beta": 0.2})
        assert caught[0].category is ConfigRenamedWarning, caught
        print(caught[0].message)
        want = AlgorithmConfig.preset("grpo", kl=KLConfig(beta=0.2))
        for preset in (by_section, by_dict, by_name):
            assert dataclasses.replace(preset, name="grpo") == want, preset
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kl_beta= is now kl.beta: pass kl={'beta': ...}" in out.stdout


def test_config_show_prints_the_resolved_algorithm_by_section(capsys):
    assert cli_main(["config", "show", str(ROOT / "configs" / "tiny_cpu.py")]) == 0
    out = capsys.readouterr().out
    assert "trainer.algorithm.kl.beta_final = 0.04" in out  # the preset's, filled in
    assert "trainer.algorithm.clip.eps_high = 0.2" in out
    assert "trainer.algorithm.kl_beta" not in out
