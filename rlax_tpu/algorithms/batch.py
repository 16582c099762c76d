"""The one batch type shared by the trainer and every objective.

A `RolloutBatch` holds what the rollouts carry (tokens, masks, groups, rewards, the
behaviour and reference log-probs, versions); the trainer computes the current
log-probs (and values, entropies) inside its loss function and passes them next to
the batch, so gradients flow only through those.

Alignment: every per-token array is aligned with the model's log-prob positions
(`rlax_tpu.models.TrainOutput`): index t scores `targets[b, t] = tokens[b, t + 1]`
given `tokens[b, :t + 1]`. `response_mask[b, t]` is true where that target is a
response token the policy sampled; prompt and padding positions are false, and so are a
multi-turn episode's given tokens (observations between turns), which the policy
conditions on but never learns from. Every part, correction and metric reads the mask,
never "the positions after the prompt": a row's response may have holes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


class MissingInputError(ValueError):
    """An objective was called without an input its configuration needs; says which."""


@struct.dataclass
class RolloutBatch:
    """A batch of scored rollouts, grouped by prompt.

    tokens: int32[batch, seq] — prompt and response token ids (model inputs).
    response_mask: bool|float[batch, seq] — 1 where targets[b, t] is a sampled response
        token (the loss mask: 0 on an episode's given tokens, as on padding).
    group_ids: int32[batch] — prompt group of each sequence, in [0, batch); groups may
        be ragged (any size) and need not be contiguous.
    rewards: float32[batch] — one scalar reward per sequence.
    behaviour_logprobs: float32[batch, seq] — log μ(targets) of the policy that sampled
        (the trainer's recomputed π_old, or the inference workers' cached values).
    versions: int32[batch] — policy version that generated each sequence.
    reference_logprobs: float32[batch, seq] | None — log π_ref(targets), for the KL
        term, trajectory balance and DPO.
    values: float32[batch, seq] | None — value-head predictions at rollout time (GAE).
    rollout_logprobs: float32[batch, seq] | None — log π_rollout(targets), the inference
        workers' own log-probs, kept when behaviour_logprobs holds the trainer's recomputed
        π_old: the rollout correction (TIS/MIS, the mismatch gate) weighs π_old/π_rollout.
    token_rewards: float32[batch, seq] | None — dense per-token rewards (process rewards,
        tool-use turns, a KL folded into the reward), added to the sequence reward, which
        arrives at each row's last sampled response token.
    token_advantages: float32[batch, seq] | None — advantages computed outside the trainer,
        used as they are by advantage="given".
    returns: float32[batch, seq] | None — value targets computed outside the trainer; the
        value loss regresses them instead of A + V_old.
    baseline_rewards: float32[batch] | None — a per-sequence reward baseline b_i (ReMax: the
        reward of the prompt's greedy response), subtracted by advantage="remax".
    token_versions: int32[batch, seq] | None — the version of each response token of a
        mixed-version rollout (aligned like behaviour_logprobs), checked against the
        staleness bound by the trainer before the step; no objective part reads it (the
        per-token log-probs carry each token's version already).
    """

    tokens: jax.Array
    response_mask: jax.Array
    group_ids: jax.Array
    rewards: jax.Array
    behaviour_logprobs: jax.Array
    versions: jax.Array
    reference_logprobs: jax.Array | None = None
    values: jax.Array | None = None
    rollout_logprobs: jax.Array | None = None
    token_rewards: jax.Array | None = None
    token_advantages: jax.Array | None = None
    returns: jax.Array | None = None
    baseline_rewards: jax.Array | None = None
    token_versions: jax.Array | None = None

    @property
    def targets(self) -> jax.Array:
        """int32[batch, seq]: tokens shifted left by one (0 at the last position)."""
        return jnp.concatenate([self.tokens[:, 1:], jnp.zeros_like(self.tokens[:, :1])], 1)

    @property
    def batch_size(self) -> int:
        return self.response_mask.shape[0]
