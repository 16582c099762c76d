"""The log-prob / entropy head: per-token log π(target) and entropies from the final hidden
states and the unembedding, optionally a chunk of tokens at a time so that neither the
forward nor the backward pass holds float32 logits [tokens, vocab] for the whole batch.

`Transformer.forward_train` calls `logprob_head`; `ForwardOptions.logprob_chunk_size`
(config `trainer.logprob_chunk_size`) picks the chunking. Chunk size 0 is the unchunked
reference; a chunked head gives the same log-probs and entropies (docs/trainer.md,
"Memory").
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from rlax_tpu.sharding import constrain

# "policy": logits[target] − logsumexp(logits), the training forward's log π_θ;
# "inference": log_softmax(logits)[target], the inference sampler's formula (the recompute
# uses it so that π_old is the workers' value rounded the same way; 1 f32 ULP apart on
# about a quarter of the tokens).
LogprobFormula = Literal["policy", "inference"]


class HeadOutput(NamedTuple):
    logprobs: jax.Array  # float32[batch, seq]: log π(targets)
    entropies: jax.Array | None  # float32[batch, seq], when asked for


def unembed(h: jax.Array, weight: jax.Array, *, tied: bool) -> jax.Array:
    """h: [b, s, embed] (compute dtype) -> float32[b, s, vocab], vocab split over the tensor
    axis. weight: the tied embedding [vocab, embed] (`tied`) or the lm_head [embed, vocab];
    it is cast to h's dtype here, so its gradient is accumulated in its own dtype."""
    w = weight.astype(h.dtype)
    spec = "bse,ve->bsv" if tied else "bse,ev->bsv"
    logits = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "length", "act_vocab"))


def _pick(x: jax.Array, targets: jax.Array) -> jax.Array:
    """x[..., targets]: float32[..., V], int32[...] -> float32[...].

    A masked sum rather than a gather: exact (one term, the rest +0), and with the vocab
    split over devices it is a local reduction and an all-reduce of [...] values, never a
    gather of the logits; its gradient is a select, not a scatter into [..., V] zeros."""
    vocab = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.sum(jnp.where(vocab == targets[..., None], x, 0.0), axis=-1)


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets] as logits[targets] − logsumexp(logits).

    logits: float[batch, seq, vocab]; targets: int32[batch, seq] -> float32[batch, seq].
    """
    logits = logits.astype(jnp.float32)
    return _pick(logits, targets) - jax.nn.logsumexp(logits, axis=-1)


def inference_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log softmax(logits)[targets] as the inference sampler computes it
    (rlax_tpu.inference.sampling.sample_tokens, "full" log-probs): the shifted logits minus
    log Σ exp, then the target's entry. float[b, s, V], int32[b, s] -> float32[b, s]."""
    return _pick(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), targets)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """float[b, s, V] -> float32[b, s]: H = logsumexp(z) − Σ softmax(z)·z."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


_FORMULAS = {"policy": token_logprobs, "inference": inference_logprobs}


def head_from_logits(
    logits: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    formula: LogprobFormula = "policy",
    entropy: bool = False,
) -> HeadOutput:
    """Log-probs (and entropies) of softmax(logits / temperature); at temperature 1 no
    division is made. logits: float32[b, s, V]; targets: int32[b, s]."""
    pick = _FORMULAS.get(formula)
    if pick is None:
        raise ValueError(f"logprob formula must be one of {sorted(_FORMULAS)}, got {formula!r}")
    if temperature != 1.0:
        logits = logits / temperature
    return HeadOutput(pick(logits, targets), entropy_from_logits(logits) if entropy else None)


def chunk_length(batch: int, seq: int, chunk_size: int) -> int:
    """Positions per row in one chunk of `chunk_size` tokens: a chunk is every row's next
    max(1, chunk_size // batch) positions (at most `seq`), so it is sharded like the batch."""
    return min(seq, max(1, chunk_size // batch))


def logprob_head(
    h: jax.Array,
    weight: jax.Array,
    targets: jax.Array,
    *,
    tied: bool,
    temperature: float = 1.0,
    formula: LogprobFormula = "policy",
    entropy: bool = False,
    chunk_size: int = 0,
) -> HeadOutput:
    """log π(targets) (and entropies) of softmax(unembed(h) / temperature).

    h: [batch, seq, embed] final-normed hidden states (compute dtype); weight: the tied
    embedding [vocab, embed] (`tied`) or the lm_head [embed, vocab]; targets: int32[batch,
    seq]; temperature: a static float > 0.

    chunk_size 0 computes the logits of all tokens at once. chunk_size > 0 scans over
    chunks of about that many tokens — every row's next `chunk_length` positions, the
    sequence padded up to a whole number of chunks — and rematerialises each chunk's logits
    in the backward pass, so forward and backward hold one chunk's float32 logits
    [batch, chunk_length, vocab] at a time instead of [batch, seq, vocab]. The log-probs
    and entropies are the unchunked ones; the weight's gradient is summed chunk by chunk
    (float32 rounding apart from the unchunked one).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = unchunked), got {chunk_size}")

    def head(h, targets):
        logits = unembed(h, weight, tied=tied)
        return head_from_logits(
            logits, targets, temperature=temperature, formula=formula, entropy=entropy
        )

    batch, seq, embed = h.shape
    length = chunk_length(batch, seq, chunk_size) if chunk_size else seq
    if length == seq:
        return head(h, targets)

    n = -(-seq // length)
    pad = n * length - seq
    if pad:  # padded positions compute a log-prob of token 0, then are dropped
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [b, n·L, ...] -> [n, b, L, ...]: the scan's leading axis, each chunk sharded like h.
    hs = jnp.moveaxis(h.reshape(batch, n, length, embed), 1, 0)
    hs = constrain(hs, (None, "batch", "length", "act_embed"))
    ts = jnp.moveaxis(targets.reshape(batch, n, length), 1, 0)

    def step(carry, xs):
        h_c, t_c = xs
        return carry, head(constrain(h_c, ("batch", "length", "act_embed")), t_c)

    # Nothing of a chunk is saved for the backward pass but its inputs: the backward scan
    # recomputes the chunk's logits, so it too holds one chunk at a time.
    step = jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False)
    _, out = jax.lax.scan(step, None, (hs, ts))

    def unchunk(x):  # [n, b, L] -> [b, seq]
        return jnp.moveaxis(x, 0, 1).reshape(batch, n * length)[:, :seq]

    return HeadOutput(
        unchunk(out.logprobs), unchunk(out.entropies) if out.entropies is not None else None
    )
