"""Token sampling for the inference engine: per-request sampling parameters, per-request
PRNG keys derived from (seed, prompt id, sample index, version), and the on-device sampler
(temperature, top-k, top-p, greedy) that also returns each token's behaviour log-prob.

Every row of a batch is sampled from its own logits and key only, so a request's tokens do
not depend on what shares its batch (the engine's batch invariance rests on this).
"""

from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

# The parameters this sampler reads are the wire type (api/inference.py), named here too.
from rlax_tpu.api.inference import LogprobsOf, SamplingParams  # noqa: F401

# Keys are threefry2x32 whatever jax_default_prng_impl says, so they are stable everywhere.
KEY_IMPL = "threefry2x32"
_KEY_DOMAIN = b"rlax_tpu.inference.request_key.v1\0"


def request_key_data(seed: int, prompt_id: str, sample_index: int, version: int) -> np.ndarray:
    """uint32[2] raw threefry key of one request: sha256 of (seed, prompt_id, sample_index,
    version) in a canonical JSON form, so it is the same in every process and on every host
    (Python's hash() is salted per process)."""
    payload = json.dumps([int(seed), str(prompt_id), int(sample_index), int(version)])
    digest = hashlib.sha256(_KEY_DOMAIN + payload.encode()).digest()
    return np.frombuffer(digest[:8], dtype=">u4").astype(np.uint32)


def request_key(seed: int, prompt_id: str, sample_index: int, version: int) -> jax.Array:
    """The request's typed PRNG key; token t of its response is sampled with fold_in(key, t)."""
    data = request_key_data(seed, prompt_id, sample_index, version)
    return jax.random.wrap_key_data(jnp.asarray(data), impl=KEY_IMPL)


def truncation_mask(logprobs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens survive top-k then top-p.

    logprobs: float32[batch, vocab] (log softmax of the temperature-scaled logits);
    top_k: int32[batch] (0 = off); top_p: float32[batch] (1 = off). Returns bool[batch, vocab].
    Ties in probability are ranked by token id (lower first).
    """
    batch, vocab = logprobs.shape
    order = jnp.argsort(-logprobs, axis=-1, stable=True)  # most likely first
    sorted_logprobs = jnp.take_along_axis(logprobs, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # Top-p on the top-k renormalised distribution: keep a token while the mass of the
    # tokens strictly more likely than it is still below top_p.
    probs = jnp.where(keep_k, jnp.exp(sorted_logprobs), 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    cumulative = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros((batch, 1)), cumulative[:, :-1]], axis=-1)
    keep_p = (top_p[:, None] >= 1.0) | (mass_before < top_p[:, None])
    keep_sorted = keep_k & keep_p
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros((batch, vocab), bool).at[rows, order].set(keep_sorted)


def sample_tokens(
    logits: jax.Array,
    key_data: jax.Array,
    token_index: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    sampled_logprobs: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and its behaviour log-prob (see SamplingParams.logprobs_of).

    logits: float32[batch, vocab]; key_data: uint32[batch, 2] (request_key_data);
    token_index: int32[batch], index t of the token in its response (key = fold_in(key, t));
    temperature, top_p: float32[batch]; top_k: int32[batch]; sampled_logprobs: bool[batch]
    (True = "sampled", False = "full"). Returns (tokens int32[batch], logprobs float32[batch]).
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    full = jax.nn.log_softmax(scaled, axis=-1)
    truncates = (top_k > 0) | (top_p < 1)

    def truncate() -> jax.Array:
        keep = truncation_mask(full, top_k, top_p) | ~truncates[:, None]
        return jnp.where(keep, scaled, -jnp.inf)

    # The sort behind truncation is the sampler's main cost; skip it when no row truncates.
    # A row that does not truncate gets exactly `scaled` either way, so its result does not
    # depend on whether another row in the batch made the sort run.
    masked = jax.lax.cond(jnp.any(truncates), truncate, lambda: scaled)
    truncated = jax.nn.log_softmax(masked, axis=-1)

    def one(data: jax.Array, index: jax.Array, row: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.wrap_key_data(data, impl=KEY_IMPL), index)
        return jax.random.categorical(key, row)

    sampled = jax.vmap(one)(key_data, token_index, masked)
    tokens = jnp.where(greedy, jnp.argmax(scaled, axis=-1), sampled).astype(jnp.int32)
    table = jnp.where(sampled_logprobs[:, None], truncated, full)
    logprobs = jnp.take_along_axis(table, tokens[:, None], axis=-1)[:, 0]
    return tokens, logprobs
