"""Online DPO on the best and worst of each group's K samples (Noukhovitch et al. 2024).

    L = 1/#groups Σ_g −log σ(β[(log π_θ(y₊) − log π_ref(y₊)) − (log π_θ(y₋) − log π_ref(y₋))])

y₊ / y₋ are the group's highest- / lowest-reward samples (first on ties), log-probs are
sequence sums, π_ref is the frozen initial policy (Rafailov et al. 2023; β = 0.1). A group
whose rewards are all equal picks one sample as both, so its margin is 0 and it adds
log 2 to the loss and nothing to the gradient, as in the authors' code.

Its `advantage/*` metrics are of the implicit per-sample advantage, the coefficient of
∇log π_θ(y) in −∇L_g: +β·σ(−β·margin_g) for y₊, −β·σ(−β·margin_g) for y₋ and 0 for the
group's other samples and for tied groups, over every sample with a response (before
the 1/#groups average).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlax_tpu.algorithms import groups
from rlax_tpu.algorithms.batch import MissingInputError, RolloutBatch
from rlax_tpu.algorithms.metrics import finish_metrics, no_clipping
from rlax_tpu.algorithms.parts import part_inputs
from rlax_tpu.algorithms.schedules import kl_beta_at
from rlax_tpu.algorithms.trajectory_balance import sequence_logprobs
from rlax_tpu.config import AlgorithmConfig


def online_dpo_loss(
    config: AlgorithmConfig,
    batch: RolloutBatch,
    logprobs: jax.Array,
    *,
    entropy: jax.Array | None = None,
    step=None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The pairwise DPO loss over groups and metrics; logprobs: float[batch, seq] log π_θ."""
    if batch.reference_logprobs is None:
        raise MissingInputError("online_dpo needs batch.reference_logprobs (the frozen π_ref)")
    p = part_inputs(batch, logprobs)
    dtype = p.mask.dtype
    beta = kl_beta_at(config, step, dtype)
    log_ratio = sequence_logprobs(logprobs, p.mask) - sequence_logprobs(
        batch.reference_logprobs, p.mask
    )
    chosen = groups.group_first_argmax(p.rewards, p.group_ids, p.valid)
    rejected = groups.group_first_argmax(-p.rewards, p.group_ids, p.valid)
    sign = chosen.astype(dtype) - rejected.astype(dtype)
    num = p.group_ids.shape[0]
    margin = jax.ops.segment_sum(sign * log_ratio, p.group_ids, num_segments=num)
    reward_gap = jax.ops.segment_sum(sign * p.rewards, p.group_ids, num_segments=num)
    present = jax.ops.segment_sum(p.valid.astype(dtype), p.group_ids, num_segments=num) > 0
    n_groups = jnp.maximum(jnp.sum(present), 1)
    loss = jnp.sum(jnp.where(present, jax.nn.softplus(-beta * margin), 0.0)) / n_groups
    pairs = present & (reward_gap > 0)
    n_pairs = jnp.maximum(jnp.sum(pairs), 1)
    sg_margin = jax.lax.stop_gradient(margin)
    # −∂L_g/∂log π_θ(y) = sign(y)·β·σ(−β·margin_g): DPO's implicit advantage per sample.
    advantage = sign * (beta * jax.nn.sigmoid(-beta * sg_margin))[p.group_ids]
    valid = p.valid.astype(dtype)
    metrics = {
        "dpo/margin_mean": jnp.sum(jnp.where(pairs, beta * sg_margin, 0.0)) / n_pairs,
        "dpo/accuracy": jnp.sum(pairs & (sg_margin > 0)) / n_pairs,
        "dpo/reward_gap_mean": jnp.sum(jnp.where(pairs, reward_gap, 0.0)) / n_pairs,
        "dpo/tied_group_fraction": 1.0 - jnp.sum(pairs) / n_groups,
        "kl_beta": beta,
        **no_clipping(dtype),  # no clip mask: both samples of a pair keep their gradient
    }
    return loss, finish_metrics(
        metrics, p, batch, advantage=advantage, advantage_mask=valid, entropy=entropy, step=step
    )
