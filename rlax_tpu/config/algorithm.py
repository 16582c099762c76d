"""The RL objective's config: a preset name plus per-part choices and hyperparameters.

Importable without JAX (the CLI reads configs before JAX starts); the JAX side that
implements the parts is rlax_tpu.algorithms, which registers exactly the built-in names
listed here (checked by tests). Parts and presets of the user's own are registered by the
modules named in `plugins` (rlax_tpu.algorithms.registry), imported when a config naming
them is validated.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import ClassVar

from rlax_tpu.config.base import ConfigBase, ConfigError, ConfigRenamedWarning, require
from rlax_tpu.user_modules import import_user_module

# Part field -> the AlgorithmConfig tuple of its built-in names.
_CHOICES = {
    "aggregation": "AGGREGATIONS",
    "importance_weight": "IMPORTANCE_WEIGHTS",
    "advantage": "ADVANTAGES",
    "gradient_mask": "GRADIENT_MASKS",
    "kl_estimator": "KL_ESTIMATORS",
}


# -- each part's knobs: one small section per part (None = the preset's value) ------------
# Every field of these sections is a number or switch of one part of the objective; a field
# left None takes the preset's value (AlgorithmConfig.resolved). Their checks need the
# preset's values, so AlgorithmConfig.validate runs them on the resolved whole.


@dataclasses.dataclass(kw_only=True, frozen=True)
class ClipConfig(ConfigBase):
    """The clip of the gradient mask M (ppo_clip, sequence_clip, sequence_log_clip)."""

    eps_low: float | None = None  # M: mask where ratio < 1 − ε_low and A < 0
    eps_high: float | None = None  # M: mask where ratio > 1 + ε_high and A > 0
    # Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): where A < 0 and the ratio
    # exceeds c the loss is the constant c·A, so M = 0 there; 0 = off, else > 1.
    dual_c: float | None = None


@dataclasses.dataclass(kw_only=True, frozen=True)
class ImportanceConfig(ConfigBase):
    """The bounds of a truncated or clipped importance weight ρ."""

    rho_min: float | None = None  # ρ: lower bound of a clipped weight
    rho_max: float | None = None  # ρ: upper bound of a truncated or clipped weight


@dataclasses.dataclass(kw_only=True, frozen=True)
class KLConfig(ConfigBase):
    """The KL regularisation to the reference π_ref: its weight β and β's schedule, how the
    estimate enters (loss term R, or folded into the reward), and the reference's resets."""

    # β of the KL-regularised objective max E[r] − β·KL(π_θ‖π_ref): the weight of R in
    # the policy-gradient objective, the reward scale 1/β of trajectory balance, and
    # DPO's β. Linear from beta to beta_final over beta_decay_steps steps (0 = constant),
    # and beta_final from beta_cut_step on (0 = never).
    beta: float | None = None
    # β after the decay (see beta)
    beta_final: float | None = None
    # steps of β's linear decay (see beta; 0 = constant)
    beta_decay_steps: int | None = None
    # β is beta_final from this step on (see beta; 0 = never)
    beta_cut_step: int | None = None
    # R: clip each token's KL estimate to ±clamp (0 = off)
    clamp: float | None = None
    # Fold the KL into the reward instead of adding the loss term R (verl's
    # use_kl_in_reward, Tunix's PPO): R_t −= β·kl_t, kl_t the kl_estimator of
    # log π_behaviour − log π_ref per token, stop-gradient.
    in_reward: bool | None = None
    # The trainer copies π_θ into π_ref every this many steps (TBA's ρ; 0 = never).
    reference_reset_every: int | None = None
    # Report `kl`, the k3 estimate of KL(π_θ‖π_ref) per response token to the reference
    # (the SFT model, or the last reference reset), even when β = 0 and nothing trains on
    # it: the trainer keeps the reference and runs one more forward pass per step.
    log_reference: bool = False


@dataclasses.dataclass(kw_only=True, frozen=True)
class AdvantageOptions(ConfigBase):
    """The knobs of the advantage estimators A (the estimator itself is `advantage`)."""

    gae_gamma: float | None = None  # A = gae, reinforce_pp_return_to_go: discount γ
    gae_lambda: float | None = None  # A = gae: λ
    # Whiten A over the batch's response tokens: (A − mean)·rsqrt(var + 1e-8), var with
    # n − 1 (verl's and Tunix's masked_whiten, which both apply it to GAE).
    whiten: bool | None = None
    pass_at_k: int | None = None  # A = pass_at_k: the k of pass@k (Chen et al. 2025)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RolloutISConfig(ConfigBase):
    """The bounds of the trainer–inference mismatch correction (`rollout_correction`) and
    its gate."""

    # The rollout correction's upper bound C (verl's rollout_is_threshold).
    threshold: float | None = None
    # MIS's lower bound C_low (0 = 1/C).
    threshold_lower: float | None = None
    # The mismatch gate (Tunix's seq_logprob_error_threshold): drop a sequence whose
    # 1/|y| Σ_t exp(|log π_old − log π_rollout|) exceeds it (0 = off, else >= 1).
    gate_threshold: float | None = None


@dataclasses.dataclass(kw_only=True, frozen=True)
class CovarianceConfig(ConfigBase):
    """Clip-Cov / KL-Cov (`covariance_control`, Cui et al. 2025)."""

    # the fraction of response tokens Clip-Cov / KL-Cov select (r, k)
    ratio: float | None = None
    # Clip-Cov's covariance window, lower end ω_low
    bounds_low: float | None = None
    # Clip-Cov's covariance window, upper end ω_high
    bounds_high: float | None = None
    # KL-Cov's penalty weight κ
    kl_coef: float | None = None


@dataclasses.dataclass(kw_only=True, frozen=True)
class SoftGateConfig(ConfigBase):
    """M = token_soft_gate (SAPO): the gate's temperatures."""

    tau_pos: float | None = None  # the gate's temperature for A > 0
    tau_neg: float | None = None  # the gate's temperature for A < 0


@dataclasses.dataclass(kw_only=True, frozen=True)
class ValueConfig(ConfigBase):
    """The value-head loss (PPO's critic)."""

    # Weight of the value-head loss; it regresses batch.returns when the batch carries
    # them, else the GAE returns A + V_old (advantage='gae').
    loss_coef: float | None = None
    clip_eps: float | None = None  # PPO value clipping around the old values (0 = off)


# Fields that moved into the part sections above (issue 39), old name -> new path, both
# inside trainer.algorithm. RENAMED_FIELDS (config/run.py) maps the old paths with a
# warning, and a plugin's register_preset may still name them.
RENAMED_ALGORITHM_FIELDS: dict[str, str] = {
    "clip_eps_low": "clip.eps_low",
    "clip_eps_high": "clip.eps_high",
    "dual_clip_c": "clip.dual_c",
    "rho_min": "importance.rho_min",
    "rho_max": "importance.rho_max",
    "kl_beta": "kl.beta",
    "kl_beta_final": "kl.beta_final",
    "kl_beta_decay_steps": "kl.beta_decay_steps",
    "kl_beta_cut_step": "kl.beta_cut_step",
    "kl_clamp": "kl.clamp",
    "kl_in_reward": "kl.in_reward",
    "reference_reset_every": "kl.reference_reset_every",
    "log_reference_kl": "kl.log_reference",
    "gae_gamma": "advantage_options.gae_gamma",
    "gae_lambda": "advantage_options.gae_lambda",
    "whiten_advantages": "advantage_options.whiten",
    "pass_at_k": "advantage_options.pass_at_k",
    "rollout_is_threshold": "rollout_is.threshold",
    "rollout_is_threshold_lower": "rollout_is.threshold_lower",
    "rollout_gate_threshold": "rollout_is.gate_threshold",
    "cov_ratio": "covariance.ratio",
    "cov_bounds_low": "covariance.bounds_low",
    "cov_bounds_high": "covariance.bounds_high",
    "cov_kl_coef": "covariance.kl_coef",
    "soft_gate_tau_pos": "soft_gate.tau_pos",
    "soft_gate_tau_neg": "soft_gate.tau_neg",
    "value_loss_coef": "value.loss_coef",
    "value_clip_eps": "value.clip_eps",
}


# Names of every part; rlax_tpu.algorithms registers exactly these (tested), and
# this module stays importable without JAX.
AGGREGATIONS = (
    "sequence_mean",
    "token_mean",
    "group_token_mean",
    "max_length",
    "sequence_sum",
)
IMPORTANCE_WEIGHTS = (
    "one",
    "token",
    "token_truncated",
    "token_clipped",
    "sequence",
    "sequence_truncated",
    "sequence_clipped",
)
ADVANTAGES = (
    "group_mean_std",
    "group_mean",
    "leave_one_out",
    "batch_norm",
    "group_mean_batch_norm",
    "gae",
    "reward",
    "given",
    "reinforce_pp_return_to_go",
    "remax",
    "opo",
    "gpg",
    "pass_at_k",
)
GRADIENT_MASKS = (
    "keep_all",
    "ppo_clip",
    "sequence_clip",
    "token_soft_gate",
    "sequence_log_clip",
)
SEQUENCE_RATIOS = ("geometric_mean", "product")
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
ROLLOUT_CORRECTIONS = ("none", "token_tis", "sequence_tis", "token_mis", "sequence_mis")
COVARIANCE_CONTROLS = ("none", "clip_cov", "kl_cov")
# Objectives outside the J above, taking the same batch.
SEPARATE_OBJECTIVES = ("trajectory_balance", "online_dpo")
# Fields only the policy-gradient objective reads.
POLICY_GRADIENT_FIELDS = (
    "aggregation",
    "importance_weight",
    "advantage",
    "gradient_mask",
    "sequence_ratio",
    "kl_estimator",
    "clip.eps_low",
    "clip.eps_high",
    "importance.rho_min",
    "importance.rho_max",
    "entropy_coef",
    "advantage_options.gae_gamma",
    "advantage_options.gae_lambda",
    "value.loss_coef",
    "value.clip_eps",
    "kl.in_reward",
    "advantage_options.whiten",
    "advantage_options.pass_at_k",
    "rollout_correction",
    "covariance_control",
    "clip.dual_c",
    "rollout_is.threshold",
    "rollout_is.threshold_lower",
    "rollout_is.gate_threshold",
    "kl.clamp",
    "covariance.ratio",
    "covariance.bounds_low",
    "covariance.bounds_high",
    "covariance.kl_coef",
    "soft_gate.tau_pos",
    "soft_gate.tau_neg",
)

# Each preset's values, as published (sources in rlax_tpu/algorithms/presets.py and
# docs/algorithms.md). Every policy-gradient preset sets every policy-gradient field.
_PG = {
    "aggregation": "sequence_mean",
    "importance_weight": "token",
    "advantage": "group_mean_std",
    "gradient_mask": "ppo_clip",
    "sequence_ratio": "geometric_mean",
    "kl_estimator": "k3",
    "clip.eps_low": 0.2,
    "clip.eps_high": 0.2,
    "importance.rho_min": 0.0,
    "importance.rho_max": 1.0,
    "kl.beta": 0.0,
    "kl.beta_final": 0.0,
    "kl.beta_decay_steps": 0,
    "kl.beta_cut_step": 0,
    "kl.reference_reset_every": 0,
    "entropy_coef": 0.0,
    "advantage_options.gae_gamma": 1.0,
    "advantage_options.gae_lambda": 0.95,
    "value.loss_coef": 0.0,
    "value.clip_eps": 0.0,
    "kl.in_reward": False,
    "advantage_options.whiten": False,
    "advantage_options.pass_at_k": 1,
    # Off in every published preset (their papers have none); the numbers are verl's
    # defaults, used when one is switched on.
    "rollout_correction": "none",
    "covariance_control": "none",
    "clip.dual_c": 0.0,
    "rollout_is.threshold": 2.0,
    "rollout_is.threshold_lower": 0.0,
    "rollout_is.gate_threshold": 0.0,
    "kl.clamp": 0.0,
    "covariance.ratio": 2e-4,
    "covariance.bounds_low": 1.0,
    "covariance.bounds_high": 5.0,
    "covariance.kl_coef": 0.1,
    "soft_gate.tau_pos": 1.0,
    "soft_gate.tau_neg": 1.05,
}
_PRESET_VALUES = {
    # Williams 1992: plain reward times the sequence log-likelihood.
    "reinforce": {
        **_PG,
        "aggregation": "sequence_sum",
        "importance_weight": "one",
        "advantage": "reward",
        "gradient_mask": "keep_all",
    },
    # Kool et al. 2019; Ahmadian et al. 2024: leave-one-out baseline.
    "rloo": {
        **_PG,
        "aggregation": "sequence_sum",
        "importance_weight": "one",
        "advantage": "leave_one_out",
        "gradient_mask": "keep_all",
    },
    # Noukhovitch et al. 2024, App. B: sequence ratio π(y)/π_old(y), PPO clip 0.2.
    "proximal_rloo": {
        **_PG,
        "aggregation": "sequence_sum",
        "importance_weight": "sequence",
        "sequence_ratio": "product",
        "advantage": "leave_one_out",
        "gradient_mask": "sequence_clip",
    },
    # Shao et al. 2024 (DeepSeekMath) Eq. 3: ε = 0.2, β = 0.04, k3.
    "grpo": {**_PG, "kl.beta": 0.04, "kl.beta_final": 0.04},
    # Yu et al. 2025: clip-higher (0.2, 0.28), token-level loss, no KL.
    "dapo": {**_PG, "aggregation": "group_token_mean", "clip.eps_high": 0.28},
    # Liu et al. 2025: no std, no length normalisation (constant L), no KL.
    "dr_grpo": {**_PG, "aggregation": "max_length", "advantage": "group_mean"},
    # Zheng et al. 2025: sequence ratio (geometric mean), clip 3e-4 / 4e-4, no KL.
    "gspo": {
        **_PG,
        "importance_weight": "sequence",
        "gradient_mask": "sequence_clip",
        "clip.eps_low": 3e-4,
        "clip.eps_high": 4e-4,
    },
    # Chen et al. 2025 (MiniMax-M1) Eq. 4: clipped IS weight, no lower bound; the
    # upper bound 8 is TBA's CISPO setting (MiniMax tuned ε_high^IS, unreported).
    "cispo": {
        **_PG,
        "aggregation": "group_token_mean",
        "importance_weight": "token_clipped",
        "gradient_mask": "keep_all",
        "importance.rho_min": 0.0,
        "importance.rho_max": 8.0,
    },
    # Hu et al. 2025, REINFORCE++-baseline (RLAX §4.2): group mean, batch std, k2 KL.
    "reinforce_pp": {
        **_PG,
        "advantage": "group_mean_batch_norm",
        "kl_estimator": "k2",
        "kl.beta": 1e-3,
        "kl.beta_final": 1e-3,
    },
    # Hu et al. 2025, REINFORCE++ proper (k >= 1): batch-normalised reward, no group
    # baseline, PPO clip 0.2, β = 0.01. The paper's k1 KL in the reward is
    # approximated by a k2 loss term (reinforce_pp_return_to_go has the exact form).
    "reinforce_pp_batch": {
        **_PG,
        "advantage": "batch_norm",
        "kl_estimator": "k2",
        "kl.beta": 0.01,
        "kl.beta_final": 0.01,
    },
    # Hu et al. 2025, REINFORCE++ as published (verl's reinforce_plus_plus): k1 KL
    # in the reward (β = 0.01), returns-to-go with γ = 1, whitened over the batch's
    # tokens, PPO clip 0.2.
    "reinforce_pp_return_to_go": {
        **_PG,
        "advantage": "reinforce_pp_return_to_go",
        "kl_estimator": "k1",
        "kl.beta": 0.01,
        "kl.beta_final": 0.01,
        "kl.in_reward": True,
    },
    # Schulman et al. 2017 + GAE 2015; LLM settings of Huang et al. 2024; advantages
    # whitened over the batch's response tokens as in verl and Tunix.
    "ppo": {
        **_PG,
        "aggregation": "token_mean",
        "advantage": "gae",
        "value.loss_coef": 0.1,
        "value.clip_eps": 0.2,
        "advantage_options.whiten": True,
    },
    # Wu et al. 2025 (LlamaRL) §6: min(π/μ, ρ), group-mean baseline, no clip mask;
    # ρ = 2, the low (low-variance) end of the recommended [2, 10].
    "aipo": {
        **_PG,
        "aggregation": "sequence_sum",
        "importance_weight": "token_truncated",
        "advantage": "group_mean",
        "gradient_mask": "keep_all",
        "importance.rho_max": 2.0,
    },
    # Li et al. 2023: A = r(y) − r(greedy y); verl's recipe: k1 KL in the reward
    # (β = 1e-3), PPO clip 0.2, token mean.
    "remax": {
        **_PG,
        "aggregation": "token_mean",
        "advantage": "remax",
        "kl_estimator": "k1",
        "kl.beta": 1e-3,
        "kl.beta_final": 1e-3,
        "kl.in_reward": True,
    },
    # Hao et al. 2025: length-weighted group baseline, no std, no KL, no entropy
    # bonus; verl's recipe: token mean, PPO clip (inert when exactly on-policy).
    "opo": {**_PG, "aggregation": "token_mean", "advantage": "opo"},
    # Chu et al. 2025: plain policy gradient (no ratio, no clip, no KL), token mean,
    # A = α(r − mean_g r), α = B/(B − #rows of all-equal groups), F_norm = 1.
    "gpg": {
        **_PG,
        "aggregation": "token_mean",
        "importance_weight": "one",
        "advantage": "gpg",
        "gradient_mask": "keep_all",
    },
    # GRPO with dual-clip PPO (Ye et al. 2020) at verl's clip_ratio_c = 3.
    "grpo_dual_clip": {**_PG, "kl.beta": 0.04, "kl.beta_final": 0.04, "clip.dual_c": 3.0},
    # Cui et al. 2025, the authors' verl recipe (7B): GRPO advantages, token mean, no
    # KL, PPO clip ε = 1 (wide), Clip-Cov on r = 2e-4 of the tokens, cov ∈ (1, 5).
    "clip_cov": {
        **_PG,
        "aggregation": "token_mean",
        "clip.eps_low": 1.0,
        "clip.eps_high": 1.0,
        "covariance_control": "clip_cov",
        "covariance.ratio": 2e-4,
        "covariance.bounds_low": 1.0,
        "covariance.bounds_high": 5.0,
    },
    # Cui et al. 2025, the authors' verl recipe (7B): unclipped ρA, KL-Cov on the top
    # k = 2e-3 of the tokens by covariance with κ = 1; token mean, no KL.
    "kl_cov": {
        **_PG,
        "aggregation": "token_mean",
        "gradient_mask": "keep_all",
        "covariance_control": "kl_cov",
        "covariance.ratio": 2e-3,
        "covariance.kl_coef": 1.0,
    },
    # Zhao et al. 2025: geometric mean of the token ratios, each clipped in log space
    # to (−0.4, 0.4) against A's sign; GRPO advantages, mean over sequences, no KL.
    "gmpo": {
        **_PG,
        "importance_weight": "sequence",
        "gradient_mask": "sequence_log_clip",
        "clip.eps_low": 0.4,
        "clip.eps_high": 0.4,
    },
    # Gao et al. 2025 (Qwen team): soft gate σ(τ(r−1))·4/τ in place of the clip,
    # τ_pos = 1, τ_neg = 1.05; GRPO advantages, sequence mean of token means, no KL.
    "sapo": {
        **_PG,
        "gradient_mask": "token_soft_gate",
        "soft_gate.tau_pos": 1.0,
        "soft_gate.tau_neg": 1.05,
    },
    # Bartoldson et al. 2025 (TBA), GSM8K Table 2: β 0.012 → 0.004 linearly by step 500.
    "trajectory_balance": {
        "kl.beta": 0.012,
        "kl.beta_final": 0.004,
        "kl.beta_decay_steps": 500,
        "kl.beta_cut_step": 0,
        "kl.reference_reset_every": 0,
    },
    # Noukhovitch et al. 2024: best/worst of K, β = 0.1, frozen reference.
    "online_dpo": {
        "kl.beta": 0.1,
        "kl.beta_final": 0.1,
        "kl.beta_decay_steps": 0,
        "kl.beta_cut_step": 0,
        "kl.reference_reset_every": 0,
    },
}


@dataclasses.dataclass(kw_only=True, frozen=True)
class AlgorithmConfig(ConfigBase):
    """The RL objective (DESIGN §6): a preset name plus per-part choices and hyperparameters.

    `name` picks a preset (`PRESET_NAMES`); every other field left at "" (a part) or None
    (a number) takes that preset's value, so `AlgorithmConfig(name="dapo")` is DAPO as
    published and `AlgorithmConfig(name="grpo", clip=ClipConfig(eps_high=0.28))` is GRPO with
    clip-higher. `resolved()` fills in the preset's values; `--set trainer.algorithm=dapo`
    (the preset, keeping only `plugins`) or `--set trainer.algorithm.name=dapo` (keeps
    explicit overrides) both work, for a plugin's presets too.

    Parts of the policy-gradient objective, per response token t of sequence i:
      J = Σ_{i,t} w_{i,t} · sg(ρ_{i,t}) · sg(A_{i,t}) · M_{i,t} · log π_θ(y_{i,t}) − β·R_{i,t}(θ)
    w `aggregation`, ρ `importance_weight`, A `advantage`, M `gradient_mask`, R the KL
    estimator `kl_estimator` with weight `kl.beta`. "trajectory_balance" and "online_dpo"
    are separate objectives on the same batch; they use only `kl` (β and
    `kl.reference_reset_every`). The JAX side is `rlax_tpu.algorithms`; docs/algorithms.md
    has the table of presets × parts with formulas and sources.
    """

    # the preset (PRESET_NAMES); fields left unset take its values
    name: str = "grpo"
    # -- parts ("" = the preset's choice) ---------------------------------------------
    aggregation: str = ""  # w
    importance_weight: str = ""  # ρ, always stop-gradient
    advantage: str = ""  # A
    gradient_mask: str = ""  # M
    # How a sequence-level ratio is formed from token ratios: GSPO's length-normalised
    # geometric mean, or the full product π(y)/μ(y) (Proximal RLOO).
    sequence_ratio: str = ""
    kl_estimator: str = ""  # R: k1, k2, k3 (Schulman's estimators of KL(π_θ‖π_ref)) or abs
    # The trainer–inference mismatch correction (rlax_tpu.algorithms.rollout_correction):
    # an extra stop-gradient factor π_old/π_rollout per token (TIS: truncated at C; MIS:
    # zeroed outside [C_low, C]), at token or sequence level; needs batch.rollout_logprobs.
    rollout_correction: str = ""  # none, token_tis, sequence_tis, token_mis, sequence_mis
    # Covariance-based entropy control (Cui et al. 2025): none, clip_cov or kl_cov.
    covariance_control: str = ""
    # -- each part's knobs (None = the preset's value) ---------------------------------
    clip: ClipConfig = ClipConfig()  # M's clip ε_low, ε_high and dual clip c
    importance: ImportanceConfig = ImportanceConfig()  # ρ's bounds
    kl: KLConfig = KLConfig()  # R's weight β, its schedule, and the reference
    advantage_options: AdvantageOptions = AdvantageOptions()  # A's γ, λ, whitening, k
    # the rollout correction's bounds C, C_low and the mismatch gate
    rollout_is: RolloutISConfig = RolloutISConfig()
    covariance: CovarianceConfig = CovarianceConfig()  # Clip-Cov / KL-Cov's r, ω, κ
    soft_gate: SoftGateConfig = SoftGateConfig()  # SAPO's temperatures
    value: ValueConfig = ValueConfig()  # the value-head loss's weight and clip
    entropy_coef: float | None = None  # weight of the entropy bonus (needs entropies)
    # L in max-length normalisation w = 1/(B·L): the generation budget; 0 = the batch's
    # padded sequence length.
    max_response_len: int = 0
    # Modules of the user's that register parts and presets (rlax_tpu.algorithms.registry):
    # dotted names or paths to .py files, imported when this config is validated.
    plugins: tuple[str, ...] = ()

    # The part names and the presets' values (module level, above the class).
    AGGREGATIONS = AGGREGATIONS
    IMPORTANCE_WEIGHTS = IMPORTANCE_WEIGHTS
    ADVANTAGES = ADVANTAGES
    GRADIENT_MASKS = GRADIENT_MASKS
    SEQUENCE_RATIOS = SEQUENCE_RATIOS
    KL_ESTIMATORS = KL_ESTIMATORS
    ROLLOUT_CORRECTIONS = ROLLOUT_CORRECTIONS
    COVARIANCE_CONTROLS = COVARIANCE_CONTROLS
    SEPARATE_OBJECTIVES = SEPARATE_OBJECTIVES
    POLICY_GRADIENT_FIELDS = POLICY_GRADIENT_FIELDS
    _PRESET_VALUES = _PRESET_VALUES

    PRESET_NAMES = tuple(_PRESET_VALUES)  # the built-in ones
    # A flat name of before the part sections, read as its new path (with a warning) when
    # this section is the root of a dict or an override.
    RENAMED = RENAMED_ALGORITHM_FIELDS
    PRESETS = {n: (lambda n=n: AlgorithmConfig(name=n)) for n in PRESET_NAMES}
    # Part names that plugins registered, by field (rlax_tpu.algorithms.registry).
    _REGISTERED_PARTS: ClassVar[dict[str, list[str]]] = {}

    @classmethod
    def choices(cls, field: str) -> tuple[str, ...]:
        """The valid names of part `field` ("advantage", ...): built-in, then registered."""
        built_in = getattr(cls, _CHOICES[field])
        return built_in + tuple(cls._REGISTERED_PARTS.get(field, ()))

    @classmethod
    def register_part_name(cls, field: str, name: str) -> None:
        """Make `name` a valid choice of part `field` (the JAX side registers the part)."""
        if name not in cls.choices(field):
            cls._REGISTERED_PARTS.setdefault(field, []).append(name)

    @classmethod
    def register_preset(cls, name: str, *, base: str, values: dict) -> AlgorithmConfig:
        """Register preset `name`: preset `base`'s values updated by `values` (fields: a part
        choice, a part section as a section or a dict, e.g. kl=KLConfig(beta=0.1), or a
        field's old flat name, e.g. kl_beta=0.1, with a ConfigRenamedWarning). Returns it
        resolved; ValueError (ConfigError) naming the problem if it does not validate."""
        if not name.isidentifier():
            raise ValueError(f"a preset name must be a Python identifier, got {name!r}")
        values = cls._preset_paths(values)
        if name in cls._PRESET_VALUES:
            if name not in cls.PRESET_NAMES and cls._PRESET_VALUES[name] == {
                **cls._PRESET_VALUES.get(base, {}),
                **values,
            }:
                return cls.preset(name)  # the same plugin imported again
            raise ValueError(f"preset {name!r} exists already; pick another name")
        if base not in cls._PRESET_VALUES:
            raise ValueError(
                f"unknown base preset {base!r}; valid presets: {', '.join(cls._PRESET_VALUES)}"
            )
        fields = {path for path, _ in cls().flat_items()} - {"name", "plugins"}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"{', '.join(unknown)} are not AlgorithmConfig fields")
        cls._PRESET_VALUES[name] = {**cls._PRESET_VALUES[base], **values}
        try:
            return cls.preset(name)
        except ValueError:
            del cls._PRESET_VALUES[name]
            raise

    @classmethod
    def _preset_paths(cls, values: dict) -> dict:
        """A preset's `values` as the dotted paths its table keeps: a part section (or a dict
        for one) becomes one path per field it sets, an old flat name its new path."""
        out = {}
        for key, value in values.items():
            if key in RENAMED_ALGORITHM_FIELDS:
                new = RENAMED_ALGORITHM_FIELDS[key]
                part, _, field = new.partition(".")
                warnings.warn(
                    f"preset {key}= is now {new}: pass {part}={{{field!r}: ...}}; the old "
                    "name works until the next release",
                    ConfigRenamedWarning,
                    stacklevel=4,
                )
                key = new
            if isinstance(value, ConfigBase):
                value = {k: v for k, v in value.to_dict().items() if v is not None}
            if isinstance(value, dict):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out

    @classmethod
    def from_preset_name(cls, name: str, current: object) -> AlgorithmConfig:
        """`--set trainer.algorithm=NAME`: preset `name`, built-in or a plugin's, with the
        section's `plugins` kept (a preset never sets them, and a plugin's preset needs its
        plugin imported wherever the config is read). An unknown name is validate's error,
        which says where a preset of one's own is registered."""
        plugins = current.plugins if isinstance(current, AlgorithmConfig) else ()
        return cls(name=name, plugins=plugins)

    @classmethod
    def preset(cls, name: str, **overrides) -> AlgorithmConfig:
        """The preset `name` with `overrides`, every field resolved."""
        return cls(name=name, **overrides).resolved()

    def value_at(self, path: str) -> object:
        """The value of field `path` ("advantage", "kl.beta"), as set (None = the preset's)."""
        value: object = self
        for key in path.split("."):
            value = getattr(value, key)
        return value

    def _inherited(self) -> dict:
        """The preset's value of every field left unset, by dotted path."""
        values = self._PRESET_VALUES[self.name]
        return {k: v for k, v in values.items() if self.value_at(k) in ("", None)}

    def resolved(self) -> AlgorithmConfig:
        """This config with every field left to the preset filled in with its value."""
        inherited = self._inherited()
        return self.updated(inherited) if inherited else self

    def updated(self, values: dict[str, object]) -> AlgorithmConfig:
        """A copy with the fields at the dotted paths of `values` ("advantage", "kl.beta")
        set, validated once as a whole."""
        top = {k: v for k, v in values.items() if "." not in k}
        parts: dict[str, dict] = {}
        for path, value in values.items():
            if "." in path:
                part, _, field = path.partition(".")
                parts.setdefault(part, {})[field] = value
        for part, fields in parts.items():
            top[part] = dataclasses.replace(getattr(self, part), **fields)
        return dataclasses.replace(self, **top)

    def rollout_correction_fields(self) -> list[str]:
        """The resolved settings that turn a rollout correction on, as "field=value": TIS/MIS
        (`rollout_correction` other than "none") and the mismatch gate
        (`rollout_is.gate_threshold`). Non-empty exactly when the objective reads the
        inference workers' own log-probs π_rollout next to the trainer's π_old."""
        c = self.resolved()
        if not c.is_policy_gradient:
            return []
        fields = []
        if c.rollout_correction != "none":
            fields.append(f"rollout_correction={c.rollout_correction!r}")
        if c.rollout_is.gate_threshold:
            fields.append(f"rollout_is.gate_threshold={c.rollout_is.gate_threshold}")
        return fields

    @property
    def is_policy_gradient(self) -> bool:
        """Whether this is the modular J above (not trajectory balance or online DPO)."""
        return self.name not in self.SEPARATE_OBJECTIVES

    def validate(self) -> None:
        check_algorithm(self)


def check_algorithm(config: AlgorithmConfig) -> None:
    """The rules across parts of an algorithm config (`AlgorithmConfig.validate`), on its
    values with the preset's filled in; a ConfigError names the field and the fix."""
    for plugin in config.plugins:
        import_user_module(plugin, f"trainer.algorithm.plugins: {plugin!r}", ConfigError)
    require(
        config.name in config._PRESET_VALUES,
        "name",
        f"unknown algorithm preset {config.name!r}; valid presets: "
        f"{', '.join(config._PRESET_VALUES)} (a preset of your own: register it in a "
        "module named in trainer.algorithm.plugins; with --set, set the plugins first)",
    )
    v = dict(config.flat_items())  # by dotted path ("kl.beta")
    v.update(config._inherited())
    for field in ("kl.beta", "kl.beta_final", "kl.beta_decay_steps", "kl.beta_cut_step"):
        require(v[field] >= 0, field, f"must be >= 0, got {v[field]}")
    require(
        v["kl.reference_reset_every"] >= 0,
        "kl.reference_reset_every",
        f"must be >= 0 (0 = never reset the reference), got {v['kl.reference_reset_every']}",
    )
    if not config.is_policy_gradient:
        _check_separate_objective(config, v)
        return
    for field, choices in (
        ("aggregation", config.choices("aggregation")),
        ("importance_weight", config.choices("importance_weight")),
        ("advantage", config.choices("advantage")),
        ("gradient_mask", config.choices("gradient_mask")),
        ("sequence_ratio", config.SEQUENCE_RATIOS),
        ("kl_estimator", config.choices("kl_estimator")),
        ("rollout_correction", config.ROLLOUT_CORRECTIONS),
        ("covariance_control", config.COVARIANCE_CONTROLS),
    ):
        require(
            v[field] in choices,
            field,
            f"unknown {field} {v[field]!r}; valid choices: {', '.join(choices)} "
            f"('' = the {config.name} preset's {config._PRESET_VALUES[config.name][field]!r})",
        )
    weight, mask = v["importance_weight"], v["gradient_mask"]
    if mask == "token_soft_gate":
        require(
            weight == "token",
            "gradient_mask",
            f"'token_soft_gate' (SAPO) gates the token ratio π_θ/μ itself; use "
            f"importance_weight='token', got {weight!r}",
        )
    elif mask == "sequence_log_clip":
        require(
            weight == "sequence" and v["sequence_ratio"] == "geometric_mean",
            "gradient_mask",
            "'sequence_log_clip' (GMPO) weighs each sequence by the geometric mean of its "
            "clipped token ratios; use importance_weight='sequence' with "
            f"sequence_ratio='geometric_mean', got {weight!r} with {v['sequence_ratio']!r}",
        )
    elif mask != "keep_all":
        require(
            weight != "one",
            "gradient_mask",
            f"{mask!r} masks by the importance ratio, but importance_weight='one' "
            f"forms none; choose a ratio weight ("
            f"{', '.join(w for w in config.IMPORTANCE_WEIGHTS if w != 'one')}) "
            "or gradient_mask='keep_all'",
        )
        level = weight.split("_")[0]
        want = "ppo_clip" if level == "token" else "sequence_clip"
        require(
            mask == want,
            "gradient_mask",
            f"{mask!r} does not match the {level}-level importance_weight={weight!r}: "
            f"the mask tests the same ratio the weight uses; use gradient_mask="
            f"{want!r} (or 'keep_all'), or a "
            f"{'sequence' if mask == 'sequence_clip' else 'token'}-level importance_weight",
        )
    require(
        0 <= v["clip.eps_low"] <= 1,
        "clip.eps_low",
        f"ε_low must be in [0, 1] (1 = no lower clip), got {v['clip.eps_low']}",
    )
    require(
        v["clip.eps_high"] >= 0,
        "clip.eps_high",
        f"ε_high must be >= 0, got {v['clip.eps_high']}",
    )
    require(
        0 <= v["importance.rho_min"] <= 1,
        "importance.rho_min",
        f"must be in [0, 1] (0 = no lower bound), got {v['importance.rho_min']}",
    )
    require(
        v["importance.rho_max"] >= 1,
        "importance.rho_max",
        f"must be >= 1, got {v['importance.rho_max']}",
    )
    for field in ("advantage_options.gae_gamma", "advantage_options.gae_lambda"):
        require(0 <= v[field] <= 1, field, f"must be in [0, 1], got {v[field]}")
    for field in ("entropy_coef", "value.loss_coef", "value.clip_eps", "max_response_len"):
        require(v[field] >= 0, field, f"must be >= 0, got {v[field]}")
    # value.loss_coef > 0 with another advantage than 'gae' regresses batch.returns;
    # whether the batch carries them is checked when the objective is called.
    require(
        not (v["kl.in_reward"] and v["advantage"] == "given"),
        "kl.in_reward",
        "advantage='given' uses batch.token_advantages as they are and reads no reward "
        "to fold the KL into; fold it in where they are computed (kl.in_reward=false), "
        "or keep the KL as the loss term (kl.in_reward=false, kl.beta > 0)",
    )
    require(
        v["advantage_options.pass_at_k"] >= 1,
        "advantage_options.pass_at_k",
        "the k of pass@k must be >= 1 (1 = pass@1, GRPO's signal), got "
        f"{v['advantage_options.pass_at_k']}",
    )
    _check_policy_loss_options(config, v)


def _check_policy_loss_options(config: AlgorithmConfig, v: dict) -> None:
    """Dual clip, the rollout correction and its gate, the KL clamp, Clip-Cov/KL-Cov and
    SAPO's temperatures (resolved values `v`)."""
    mask, correction = v["gradient_mask"], v["rollout_correction"]
    require(
        v["clip.dual_c"] == 0 or v["clip.dual_c"] > 1,
        "clip.dual_c",
        "must be > 1 (an A < 0 token's loss is capped at c·A once its ratio exceeds c; "
        f"verl's default is 3) or 0 (off), got {v['clip.dual_c']}",
    )
    require(
        not v["clip.dual_c"] or mask in ("ppo_clip", "sequence_clip"),
        "clip.dual_c",
        f"dual clip extends PPO's clip mask, and gradient_mask={mask!r} is none; use "
        "gradient_mask='ppo_clip' (or 'sequence_clip'), or set clip.dual_c=0",
    )
    upper = v["rollout_is.threshold"]
    require(upper >= 1, "rollout_is.threshold", f"C must be >= 1, got {upper}")
    lower = v["rollout_is.threshold_lower"]
    require(
        0 <= lower <= upper,
        "rollout_is.threshold_lower",
        f"must be in [0, rollout_is.threshold={upper}] (0 = 1/C), got {lower}",
    )
    require(
        lower == 0 or correction.endswith("_mis"),
        "rollout_is.threshold_lower",
        f"is MIS's lower bound, unused by rollout_correction={correction!r}; set it to "
        "0, or rollout_correction='token_mis' or 'sequence_mis'",
    )
    gate = v["rollout_is.gate_threshold"]
    require(
        gate == 0 or gate >= 1,
        "rollout_is.gate_threshold",
        "bounds the mean of exp(|log π_old − log π_rollout|) over a sequence, which is "
        f">= 1 (1 = exact agreement): set it >= 1 (e.g. 2) or 0 (off), got {gate}",
    )
    require(v["kl.clamp"] >= 0, "kl.clamp", f"must be >= 0 (0 = off), got {v['kl.clamp']}")
    require(
        0 < v["covariance.ratio"] <= 1,
        "covariance.ratio",
        f"the fraction of response tokens selected must be in (0, 1], got {v['covariance.ratio']}",
    )
    require(
        v["covariance.bounds_low"] < v["covariance.bounds_high"],
        "covariance.bounds_high",
        "Clip-Cov's window (covariance.bounds_low, covariance.bounds_high) = "
        f"({v['covariance.bounds_low']}, {v['covariance.bounds_high']}) is empty; make "
        "covariance.bounds_high > covariance.bounds_low",
    )
    require(
        v["covariance.kl_coef"] >= 0,
        "covariance.kl_coef",
        f"must be >= 0, got {v['covariance.kl_coef']}",
    )
    require(
        v["covariance_control"] == "none"
        or v["importance_weight"].split("_")[0] in ("token", "one"),
        "covariance_control",
        f"{v['covariance_control']!r} selects single tokens by their covariance; use a "
        f"token-level importance_weight, got {v['importance_weight']!r}",
    )
    for field in ("soft_gate.tau_pos", "soft_gate.tau_neg"):
        require(v[field] > 0, field, f"the gate's temperature must be > 0, got {v[field]}")


def _check_separate_objective(config: AlgorithmConfig, v: dict) -> None:
    uses = "kl.beta (and its schedule) and kl.reference_reset_every"
    for field in config.POLICY_GRADIENT_FIELDS:
        require(
            config.value_at(field) in ("", None),
            field,
            f"is not used by {config.name}, a separate objective that uses only {uses}; "
            "leave it unset or pick a policy-gradient preset",
        )
    require(
        config.max_response_len == 0,
        "max_response_len",
        f"is not used by {config.name}, a separate objective that uses only {uses}",
    )
    for field in ("kl.beta", "kl.beta_final"):
        require(
            v[field] > 0,
            field,
            f"{config.name} needs β > 0 (it scales the log-ratio to the reference), got {v[field]}",
        )
    if config.name == "online_dpo":
        require(
            v["kl.reference_reset_every"] == 0,
            "kl.reference_reset_every",
            "online DPO's reference is the frozen initial policy; set it to 0",
        )
