"""The RL objective's config: a preset name plus per-part choices and hyperparameters.

Importable without JAX (the CLI reads configs before JAX starts); the JAX side that
implements the parts is rlax_tpu.algorithms, which registers exactly the names listed
here (checked by tests).
"""

from __future__ import annotations

import dataclasses

from rlax_tpu.config.base import ConfigBase, require


@dataclasses.dataclass(kw_only=True, frozen=True)
class AlgorithmConfig(ConfigBase):
    """The RL objective (DESIGN §6): a preset name plus per-part choices and hyperparameters.

    `name` picks a preset (`PRESET_NAMES`); every other field left at "" (a part) or None
    (a number) takes that preset's value, so `AlgorithmConfig(name="dapo")` is DAPO as
    published and `AlgorithmConfig(name="grpo", clip_eps_high=0.28)` is GRPO with
    clip-higher. `resolved()` fills in the preset's values; `--set trainer.algorithm=dapo`
    (a preset) or `--set trainer.algorithm.name=dapo` (keeps explicit overrides) both work.

    Parts of the policy-gradient objective, per response token t of sequence i:
      J = Σ_{i,t} w_{i,t} · sg(ρ_{i,t}) · sg(A_{i,t}) · M_{i,t} · log π_θ(y_{i,t}) − β·R_{i,t}(θ)
    w `aggregation`, ρ `importance_weight`, A `advantage`, M `gradient_mask`, R the KL
    estimator `kl_estimator` with weight `kl_beta`. "trajectory_balance" and "online_dpo"
    are separate objectives on the same batch; they use only the β fields and
    `reference_reset_every`. The JAX side is `rlax_tpu.algorithms`; docs/algorithms.md
    has the table of presets × parts with formulas and sources.
    """

    name: str = "grpo"
    # -- parts ("" = the preset's choice) ---------------------------------------------
    aggregation: str = ""  # w
    importance_weight: str = ""  # ρ, always stop-gradient
    advantage: str = ""  # A
    gradient_mask: str = ""  # M
    # How a sequence-level ratio is formed from token ratios: GSPO's length-normalised
    # geometric mean, or the full product π(y)/μ(y) (Proximal RLOO).
    sequence_ratio: str = ""
    kl_estimator: str = ""  # R: k1, k2 or k3 (Schulman's estimators of KL(π_θ‖π_ref))
    # -- hyperparameters (None = the preset's value) ----------------------------------
    clip_eps_low: float | None = None  # M: mask where ratio < 1 − ε_low and A < 0
    clip_eps_high: float | None = None  # M: mask where ratio > 1 + ε_high and A > 0
    rho_min: float | None = None  # ρ: lower bound of a clipped weight
    rho_max: float | None = None  # ρ: upper bound of a truncated or clipped weight
    # β of the KL-regularised objective max E[r] − β·KL(π_θ‖π_ref): the weight of R in
    # the policy-gradient objective, the reward scale 1/β of trajectory balance, and
    # DPO's β. Linear from kl_beta to kl_beta_final over kl_beta_decay_steps steps
    # (0 = constant), and kl_beta_final from kl_beta_cut_step on (0 = never).
    kl_beta: float | None = None
    kl_beta_final: float | None = None
    kl_beta_decay_steps: int | None = None
    kl_beta_cut_step: int | None = None
    # The trainer copies π_θ into π_ref every this many steps (TBA's ρ; 0 = never).
    reference_reset_every: int | None = None
    entropy_coef: float | None = None  # weight of the entropy bonus (needs entropies)
    gae_gamma: float | None = None  # A = gae: discount γ
    gae_lambda: float | None = None  # A = gae: λ
    value_loss_coef: float | None = None  # weight of the value-head loss (A = gae)
    value_clip_eps: float | None = None  # PPO value clipping around the old values (0 = off)
    # L in max-length normalisation w = 1/(B·L): the generation budget; 0 = the batch's
    # padded sequence length.
    max_response_len: int = 0

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
    )
    GRADIENT_MASKS = ("keep_all", "ppo_clip", "sequence_clip")
    SEQUENCE_RATIOS = ("geometric_mean", "product")
    KL_ESTIMATORS = ("k1", "k2", "k3")
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
        "clip_eps_low",
        "clip_eps_high",
        "rho_min",
        "rho_max",
        "entropy_coef",
        "gae_gamma",
        "gae_lambda",
        "value_loss_coef",
        "value_clip_eps",
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
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.2,
        "rho_min": 0.0,
        "rho_max": 1.0,
        "kl_beta": 0.0,
        "kl_beta_final": 0.0,
        "kl_beta_decay_steps": 0,
        "kl_beta_cut_step": 0,
        "reference_reset_every": 0,
        "entropy_coef": 0.0,
        "gae_gamma": 1.0,
        "gae_lambda": 0.95,
        "value_loss_coef": 0.0,
        "value_clip_eps": 0.0,
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
        "grpo": {**_PG, "kl_beta": 0.04, "kl_beta_final": 0.04},
        # Yu et al. 2025: clip-higher (0.2, 0.28), token-level loss, no KL.
        "dapo": {**_PG, "aggregation": "group_token_mean", "clip_eps_high": 0.28},
        # Liu et al. 2025: no std, no length normalisation (constant L), no KL.
        "dr_grpo": {**_PG, "aggregation": "max_length", "advantage": "group_mean"},
        # Zheng et al. 2025: sequence ratio (geometric mean), clip 3e-4 / 4e-4, no KL.
        "gspo": {
            **_PG,
            "importance_weight": "sequence",
            "gradient_mask": "sequence_clip",
            "clip_eps_low": 3e-4,
            "clip_eps_high": 4e-4,
        },
        # Chen et al. 2025 (MiniMax-M1) Eq. 4: clipped IS weight, no lower bound; the
        # upper bound 8 is TBA's CISPO setting (MiniMax tuned ε_high^IS, unreported).
        "cispo": {
            **_PG,
            "aggregation": "group_token_mean",
            "importance_weight": "token_clipped",
            "gradient_mask": "keep_all",
            "rho_min": 0.0,
            "rho_max": 8.0,
        },
        # Hu et al. 2025, REINFORCE++-baseline (RLAX §4.2): group mean, batch std, k2 KL.
        "reinforce_pp": {
            **_PG,
            "advantage": "group_mean_batch_norm",
            "kl_estimator": "k2",
            "kl_beta": 1e-3,
            "kl_beta_final": 1e-3,
        },
        # Hu et al. 2025, REINFORCE++ proper (k >= 1): batch-normalised reward, no group
        # baseline, PPO clip 0.2, β = 0.01. The paper's k1 KL in the reward is
        # approximated by a k2 loss term (the parts cannot fold a KL into the reward).
        "reinforce_pp_batch": {
            **_PG,
            "advantage": "batch_norm",
            "kl_estimator": "k2",
            "kl_beta": 0.01,
            "kl_beta_final": 0.01,
        },
        # Schulman et al. 2017 + GAE 2015; LLM settings of Huang et al. 2024.
        "ppo": {
            **_PG,
            "aggregation": "token_mean",
            "advantage": "gae",
            "value_loss_coef": 0.1,
            "value_clip_eps": 0.2,
        },
        # Wu et al. 2025 (LlamaRL) §6: min(π/μ, ρ), group-mean baseline, no clip mask;
        # ρ = 2, the low (low-variance) end of the recommended [2, 10].
        "aipo": {
            **_PG,
            "aggregation": "sequence_sum",
            "importance_weight": "token_truncated",
            "advantage": "group_mean",
            "gradient_mask": "keep_all",
            "rho_max": 2.0,
        },
        # Bartoldson et al. 2025 (TBA), GSM8K Table 2: β 0.012 → 0.004 linearly by step 500.
        "trajectory_balance": {
            "kl_beta": 0.012,
            "kl_beta_final": 0.004,
            "kl_beta_decay_steps": 500,
            "kl_beta_cut_step": 0,
            "reference_reset_every": 0,
        },
        # Noukhovitch et al. 2024: best/worst of K, β = 0.1, frozen reference.
        "online_dpo": {
            "kl_beta": 0.1,
            "kl_beta_final": 0.1,
            "kl_beta_decay_steps": 0,
            "kl_beta_cut_step": 0,
            "reference_reset_every": 0,
        },
    }
    PRESET_NAMES = tuple(_PRESET_VALUES)
    PRESETS = {n: (lambda n=n: AlgorithmConfig(name=n)) for n in PRESET_NAMES}

    @classmethod
    def preset(cls, name: str, **overrides) -> AlgorithmConfig:
        """The preset `name` with `overrides`, every field resolved."""
        return cls(name=name, **overrides).resolved()

    def _inherited(self) -> dict:
        values = self._PRESET_VALUES[self.name]
        return {k: v for k, v in values.items() if getattr(self, k) in ("", None)}

    def resolved(self) -> AlgorithmConfig:
        """This config with every field left to the preset filled in with its value."""
        inherited = self._inherited()
        return dataclasses.replace(self, **inherited) if inherited else self

    @property
    def is_policy_gradient(self) -> bool:
        """Whether this is the modular J above (not trajectory balance or online DPO)."""
        return self.name not in self.SEPARATE_OBJECTIVES

    def validate(self) -> None:
        require(
            self.name in self.PRESET_NAMES,
            "name",
            f"unknown algorithm preset {self.name!r}; valid presets: "
            f"{', '.join(self.PRESET_NAMES)}",
        )
        v = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        v.update(self._inherited())
        for field in ("kl_beta", "kl_beta_final", "kl_beta_decay_steps", "kl_beta_cut_step"):
            require(v[field] >= 0, field, f"must be >= 0, got {v[field]}")
        require(
            v["reference_reset_every"] >= 0,
            "reference_reset_every",
            f"must be >= 0 (0 = never reset the reference), got {v['reference_reset_every']}",
        )
        if not self.is_policy_gradient:
            self._validate_separate_objective(v)
            return
        for field, choices in (
            ("aggregation", self.AGGREGATIONS),
            ("importance_weight", self.IMPORTANCE_WEIGHTS),
            ("advantage", self.ADVANTAGES),
            ("gradient_mask", self.GRADIENT_MASKS),
            ("sequence_ratio", self.SEQUENCE_RATIOS),
            ("kl_estimator", self.KL_ESTIMATORS),
        ):
            require(
                v[field] in choices,
                field,
                f"unknown {field} {v[field]!r}; valid choices: {', '.join(choices)} "
                f"('' = the {self.name} preset's {self._PRESET_VALUES[self.name][field]!r})",
            )
        weight, mask = v["importance_weight"], v["gradient_mask"]
        if mask != "keep_all":
            require(
                weight != "one",
                "gradient_mask",
                f"{mask!r} masks by the importance ratio, but importance_weight='one' "
                f"forms none; choose a ratio weight ("
                f"{', '.join(w for w in self.IMPORTANCE_WEIGHTS if w != 'one')}) "
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
            0 <= v["clip_eps_low"] < 1,
            "clip_eps_low",
            f"ε_low must be in [0, 1), got {v['clip_eps_low']}",
        )
        require(
            v["clip_eps_high"] >= 0,
            "clip_eps_high",
            f"ε_high must be >= 0, got {v['clip_eps_high']}",
        )
        require(
            0 <= v["rho_min"] <= 1,
            "rho_min",
            f"must be in [0, 1] (0 = no lower bound), got {v['rho_min']}",
        )
        require(v["rho_max"] >= 1, "rho_max", f"must be >= 1, got {v['rho_max']}")
        for field in ("gae_gamma", "gae_lambda"):
            require(0 <= v[field] <= 1, field, f"must be in [0, 1], got {v[field]}")
        for field in ("entropy_coef", "value_loss_coef", "value_clip_eps", "max_response_len"):
            require(v[field] >= 0, field, f"must be >= 0, got {v[field]}")
        require(
            v["value_loss_coef"] == 0 or v["advantage"] == "gae",
            "value_loss_coef",
            f"the value head regresses GAE returns; with advantage={v['advantage']!r} "
            "set value_loss_coef=0 or advantage='gae'",
        )

    def _validate_separate_objective(self, v: dict) -> None:
        uses = "kl_beta (and its schedule) and reference_reset_every"
        for field in self.POLICY_GRADIENT_FIELDS:
            require(
                getattr(self, field) in ("", None),
                field,
                f"is not used by {self.name}, a separate objective that uses only {uses}; "
                "leave it unset or pick a policy-gradient preset",
            )
        require(
            self.max_response_len == 0,
            "max_response_len",
            f"is not used by {self.name}, a separate objective that uses only {uses}",
        )
        for field in ("kl_beta", "kl_beta_final"):
            require(
                v[field] > 0,
                field,
                f"{self.name} needs β > 0 (it scales the log-ratio to the reference), "
                f"got {v[field]}",
            )
        if self.name == "online_dpo":
            require(
                v["reference_reset_every"] == 0,
                "reference_reset_every",
                "online DPO's reference is the frozen initial policy; set it to 0",
            )
