"""The modular RL objective (DESIGN §6): parts, their registries, presets and metrics.

    objective = build_objective(AlgorithmConfig(name="dapo"))
    loss, metrics = objective(batch, logprobs, values=None, entropy=None, step=step)

`RolloutBatch` is the batch shared with the trainer; gradients flow only through the
log-probs (and values, entropies) passed next to it. Algorithms are configurations of
the parts in `parts` (w, ρ, A, M, R); trajectory balance and online DPO are separate
objectives on the same inputs (DAPO's group filter is the controller's, controller.filters);
`reference_reset_due` tells the trainer when to reset π_ref.
`REQUIRED_METRICS` names the metrics every objective reports. `register_part` and
`register_preset` add parts and presets from the user's own module (`registry`)."""

from rlax_tpu.algorithms.batch import MissingInputError, RolloutBatch
from rlax_tpu.algorithms.covariance import COVARIANCE_CONTROLS
from rlax_tpu.algorithms.dpo import online_dpo_loss
from rlax_tpu.algorithms.metrics import REFERENCE_METRICS, REQUIRED_METRICS
from rlax_tpu.algorithms.objective import (
    Objective,
    build_objective,
    describe,
    objective,
    policy_gradient_loss,
)
from rlax_tpu.algorithms.parts import (
    ADVANTAGES,
    AGGREGATIONS,
    GRADIENT_MASKS,
    IMPORTANCE_WEIGHTS,
    KL_ESTIMATORS,
    gae,
)
from rlax_tpu.algorithms.presets import PRESETS, preset
from rlax_tpu.algorithms.registry import RegistrationError, register_part, register_preset
from rlax_tpu.algorithms.rollout_correction import ROLLOUT_CORRECTIONS
from rlax_tpu.algorithms.schedules import kl_beta_at, reference_reset_due
from rlax_tpu.algorithms.trajectory_balance import trajectory_balance_loss

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "COVARIANCE_CONTROLS",
    "GRADIENT_MASKS",
    "IMPORTANCE_WEIGHTS",
    "KL_ESTIMATORS",
    "MissingInputError",
    "Objective",
    "PRESETS",
    "REFERENCE_METRICS",
    "REQUIRED_METRICS",
    "ROLLOUT_CORRECTIONS",
    "RegistrationError",
    "RolloutBatch",
    "build_objective",
    "describe",
    "gae",
    "kl_beta_at",
    "objective",
    "online_dpo_loss",
    "policy_gradient_loss",
    "preset",
    "reference_reset_due",
    "register_part",
    "register_preset",
    "trajectory_balance_loss",
]
