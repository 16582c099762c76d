"""The sampler: top-k/top-p masks and both kinds of behaviour log-probs against a numpy
reference, greedy decoding, and the per-request PRNG key derivation."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tpu.config import InferenceConfig
from rlax_tpu.inference.sampling import (
    SamplingParams,
    request_key,
    request_key_data,
    sample_tokens,
    truncation_mask,
)

VOCAB = 64


def ref_truncation(logits, temperature, top_k, top_p):
    """numpy float64: the kept set of top-k then top-p on the top-k renormalised dist."""
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    kept = order[:top_k] if top_k > 0 else order
    if top_p >= 1:
        keep[kept] = True
        return keep
    mass = probs[kept] / probs[kept].sum()
    n = int(np.searchsorted(np.cumsum(mass), top_p)) + 1  # smallest prefix reaching top_p
    keep[kept[:n]] = True
    return keep


def ref_logprobs(logits, temperature, keep):
    """numpy float64 (full, truncated) log-probs of every token."""
    scaled = logits.astype(np.float64) / (temperature if temperature > 0 else 1.0)
    full = scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
    masked = np.where(keep, scaled, -np.inf)
    truncated = masked - masked.max() - np.log(np.exp(masked - masked.max()).sum())
    return full, truncated


def sample(logits, *, temperature=1.0, top_k=0, top_p=1.0, mode="full", seed=0, index=None):
    """sample_tokens on rows of `logits` float32[batch, vocab] with shared params."""
    batch = logits.shape[0]
    key_data = np.stack([request_key_data(seed, f"p{i}", 0, 0) for i in range(batch)])
    index = np.zeros(batch, np.int32) if index is None else index
    tokens, logprobs = jax.jit(sample_tokens)(
        jnp.asarray(logits, jnp.float32),
        key_data,
        jnp.asarray(index, jnp.int32),
        jnp.full(batch, temperature, jnp.float32),
        jnp.full(batch, top_k, jnp.int32),
        jnp.full(batch, top_p, jnp.float32),
        jnp.full(batch, mode == "sampled"),
    )
    return np.asarray(tokens), np.asarray(logprobs)


def random_logits(batch, seed=0, scale=3.0):
    return (scale * np.random.default_rng(seed).standard_normal((batch, VOCAB))).astype(np.float32)


@pytest.mark.parametrize(
    "top_k, top_p", [(1, 1.0), (5, 1.0), (20, 1.0), (0, 0.5), (0, 0.9), (20, 0.9), (3, 0.3)]
)
def test_truncation_mask_equals_reference(top_k, top_p):
    logits = random_logits(16, seed=top_k)
    temperature = 0.7
    logprobs = jax.nn.log_softmax(jnp.asarray(logits) / temperature, axis=-1)
    got = np.asarray(
        truncation_mask(logprobs, jnp.full(16, top_k, jnp.int32), jnp.full(16, top_p, jnp.float32))
    )
    for row in range(16):
        want = ref_truncation(logits[row], temperature, top_k, top_p)
        np.testing.assert_array_equal(got[row], want)
        if top_k:
            assert got[row].sum() <= top_k


def test_truncation_off_keeps_every_token_even_when_cumulative_mass_rounds_to_one():
    # Very peaked rows: the float32 cumulative mass reaches 1.0 long before the last token.
    logits = random_logits(4, scale=40.0)
    logprobs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
    keep = truncation_mask(logprobs, jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32))
    assert np.asarray(keep).all()


def test_greedy_at_temperature_zero_is_argmax_for_any_key():
    logits = random_logits(8)
    want = logits.argmax(axis=-1)
    for seed in range(3):
        tokens, logprobs = sample(logits, temperature=0.0, seed=seed, index=np.arange(8) * seed)
        np.testing.assert_array_equal(tokens, want)
        full, _ = ref_logprobs(logits[0], 0.0, np.ones(VOCAB, bool))
        # At temperature 0 log-probs are those of softmax(logits) (temperature 1).
        np.testing.assert_allclose(logprobs[0], full[want[0]], atol=1e-5)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 20, 0.9), (0.7, 0, 0.8), (1.3, 5, 1)])
def test_full_and_sampled_logprobs_equal_reference(temperature, top_k, top_p):
    logits = random_logits(32, seed=1)
    params = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    tokens_full, lp_full = sample(logits, mode="full", **params)
    tokens_sampled, lp_sampled = sample(logits, mode="sampled", **params)
    # The mode changes what is reported, never which token is drawn.
    np.testing.assert_array_equal(tokens_full, tokens_sampled)
    for row, token in enumerate(tokens_full):
        keep = ref_truncation(logits[row], temperature, top_k, top_p)
        assert keep[token], "a truncated-away token was sampled"
        full, truncated = ref_logprobs(logits[row], temperature, keep)
        np.testing.assert_allclose(lp_full[row], full[token], atol=1e-5)
        np.testing.assert_allclose(lp_sampled[row], truncated[token], atol=1e-5)
        # Renormalising over the kept tokens raises each log-prob by -log(kept mass) > 0.
        mass = np.exp(full[keep]).sum()
        np.testing.assert_allclose(lp_sampled[row] - lp_full[row], -np.log(mass), atol=1e-5)
        assert mass < 1 - 1e-3 and lp_sampled[row] > lp_full[row]


def test_samples_follow_the_truncated_distribution():
    logits = random_logits(1, seed=2, scale=1.0)
    n = 4000
    tokens, _ = sample(
        np.repeat(logits, n, axis=0),
        temperature=0.8,
        top_k=10,
        top_p=0.8,
        index=np.arange(n),  # one key per row, fold_in(key_row, t)
    )
    keep = ref_truncation(logits[0], 0.8, 10, 0.8)
    _, truncated = ref_logprobs(logits[0], 0.8, keep)
    counts = np.bincount(tokens, minlength=VOCAB) / n
    assert counts[~keep].sum() == 0
    assert 0.5 * np.abs(counts - np.exp(truncated)).sum() < 0.05  # total variation


def test_token_index_changes_the_draw_and_same_inputs_repeat_it():
    logits = np.repeat(random_logits(1, scale=0.1), 8, axis=0)
    a, _ = sample(logits, index=np.zeros(8))
    b, _ = sample(logits, index=np.zeros(8))
    c, _ = sample(logits, index=np.arange(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_request_key_is_the_same_in_another_process():
    args = (1234, "prompt/42", 3, 7)
    code = (
        "from rlax_tpu.inference.sampling import request_key_data;"
        f"print(list(request_key_data(*{args!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert eval(out) == list(request_key_data(*args))
    assert request_key_data(*args).dtype == np.uint32
    key = request_key(*args)
    np.testing.assert_array_equal(jax.random.key_data(key), request_key_data(*args))


def test_request_key_depends_on_every_part():
    base = (0, "p", 0, 0)
    variants = [base, (1, "p", 0, 0), (0, "q", 0, 0), (0, "p", 1, 0), (0, "p", 0, 1)]
    # Concatenation ambiguities must not collide either.
    variants += [(0, "p1", 0, 0), (0, "p", 10, 0), (1, "0", 0, 0), (10, "", 0, 0)]
    keys = {tuple(request_key_data(*v)) for v in variants}
    assert len(keys) == len(variants)


def test_sampling_params_from_config_and_validation():
    cfg = InferenceConfig(
        temperature=0.5, top_p=0.9, top_k=7, stop_token_ids=(2,), max_new_tokens=9
    )
    params = SamplingParams.from_config(cfg)
    assert (params.temperature, params.top_p, params.top_k) == (0.5, 0.9, 7)
    assert params.stop_token_ids == (2,) and params.max_new_tokens == 9
    assert params.logprobs_of == "full"
    for bad in (
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-1),
        dict(max_new_tokens=0),
        dict(logprobs_of="truncated"),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
