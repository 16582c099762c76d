"""Trajectory balance with a VarGrad log Z (TBA, Bartoldson et al. 2025, Eqs. 4–5).

    log Ẑ(x) = 1/K Σ_j [log π_ref(y_j|x) − log π_θ(y_j|x) + r(y_j, x)/β]   (per prompt group)
    L = 1/(BK) Σ_{i,j} (sg[log Ẑ(x_i)] + log π_θ(y_ij|x_i) − log π_ref(y_ij|x_i) − r_ij/β)²

Log-probs are sequence sums over response tokens. The target π* ∝ π_ref·exp(r/β) is the
optimum of max E[r] − β·KL(π‖π_ref) (Eq. 2), so the loss is off-policy: nothing in it
depends on the behaviour policy. By TBA App. A, (β/2)·∇L = −1/(BK) Σ A_ij ∇log π_θ(y_ij)
with A_ij = (r_ij − r̄_i) − β(KL̂_ij − KL̄_i), KL̂ = log π_θ − log π_ref: on-policy, REINFORCE
with a mean baseline and a KL-shaped reward. β follows the schedule in `schedules`, and
the trainer resets π_ref every `kl.reference_reset_every` steps. Groups may be ragged (K_i).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups
from rlax_tpu.algorithms.batch import MissingInputError, RolloutBatch
from rlax_tpu.algorithms.metrics import finish_metrics, masked_mean, no_clipping
from rlax_tpu.algorithms.parts import part_inputs
from rlax_tpu.algorithms.schedules import kl_beta_at
from rlax_tpu.config import AlgorithmConfig


def sequence_logprobs(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """float[batch]: Σ_t log-probs over response tokens (padding may hold -inf or NaN)."""
    return jnp.sum(jnp.where(mask > 0, logprobs.astype(mask.dtype), 0.0), axis=1)


def trajectory_balance_loss(
    config: AlgorithmConfig,
    batch: RolloutBatch,
    logprobs: jax.Array,
    *,
    entropy: jax.Array | None = None,
    step=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The VarGrad TB loss (Eq. 5) and metrics; logprobs: float[batch, seq] log π_θ."""
    if batch.reference_logprobs is None:
        raise MissingInputError(
            "trajectory_balance needs batch.reference_logprobs: its target is π_ref·exp(r/β)"
        )
    p = part_inputs(batch, logprobs)
    beta = kl_beta_at(config, step, p.mask.dtype)
    seq_lp = sequence_logprobs(logprobs, p.mask)
    seq_ref = sequence_logprobs(batch.reference_logprobs, p.mask)
    scaled_reward = p.rewards / beta
    log_z = groups.group_mean(
        seq_ref - jax.lax.stop_gradient(seq_lp) + scaled_reward, p.group_ids, p.valid
    )
    residual = jax.lax.stop_gradient(log_z) + seq_lp - seq_ref - scaled_reward
    valid = p.valid.astype(p.mask.dtype)
    n = jnp.maximum(jnp.sum(valid), 1)
    loss = jnp.sum(jnp.where(p.valid, residual, 0.0) ** 2) / n
    # The advantage TB's gradient applies (App. A): A = −β·residual.
    advantage = -beta * jax.lax.stop_gradient(residual)
    metrics = {
        "tb/residual_abs_mean": masked_mean(jnp.abs(jax.lax.stop_gradient(residual)), valid),
        "tb/log_z_mean": masked_mean(jax.lax.stop_gradient(log_z), valid),
        "tb/sequence_kl_mean": masked_mean(jax.lax.stop_gradient(seq_lp) - seq_ref, valid),
        "kl_beta": beta,
        **no_clipping(p.mask.dtype),  # no clip mask: every sample keeps its gradient
    }
    return loss, finish_metrics(
        metrics, p, batch, advantage=advantage, advantage_mask=valid, entropy=entropy, step=step
    )
