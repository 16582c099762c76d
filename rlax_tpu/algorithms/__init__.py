"""The modular RL objective (DESIGN §6): parts, their registries, presets and metrics.

    objective = build_objective(AlgorithmConfig(name="dapo"))
    loss, metrics = objective(batch, logprobs, values=None, entropy=None, step=step)

`RolloutBatch` is the batch shared with the trainer; gradients flow only through the
log-probs (and values, entropies) passed next to it. Algorithms are configurations of
the parts in `parts` (w, ρ, A, M, R); trajectory balance and online DPO are separate
objectives on the same inputs. `dynamic_sampling_keep` is DAPO's group filter for the
controller; `reference_reset_due` tells the trainer when to reset π_ref.
`REQUIRED_METRICS` names the metrics every objective reports. `register_part` and
`register_preset` add parts and presets from the user's own module (`registry`)."""

from rlax_tpu._lazy import lazy_exports

# Public name -> the submodule defining it; imported on first use (rlax_tpu._lazy).
_EXPORTS = {
    "MissingInputError": "batch",
    "RolloutBatch": "batch",
    "online_dpo_loss": "dpo",
    "COVARIANCE_CONTROLS": "covariance",
    "dynamic_sampling_keep": "filters",
    "REFERENCE_METRICS": "metrics",
    "REQUIRED_METRICS": "metrics",
    "Objective": "objective",
    "build_objective": "objective",
    "describe": "objective",
    "objective": "objective",
    "policy_gradient_loss": "objective",
    "ADVANTAGES": "parts",
    "AGGREGATIONS": "parts",
    "GRADIENT_MASKS": "parts",
    "IMPORTANCE_WEIGHTS": "parts",
    "KL_ESTIMATORS": "parts",
    "gae": "parts",
    "PRESETS": "presets",
    "RegistrationError": "registry",
    "register_part": "registry",
    "register_preset": "registry",
    "preset": "presets",
    "kl_beta_at": "schedules",
    "reference_reset_due": "schedules",
    "ROLLOUT_CORRECTIONS": "rollout_correction",
    "trajectory_balance_loss": "trajectory_balance",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
