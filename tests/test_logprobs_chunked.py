"""The chunked log-prob / entropy head (rlax_tpu.models.logprobs) gives the unchunked
head's log-probs, entropies and gradients, sharded too, while holding one chunk's logits."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rlax_tpu.config import DEFAULT_LOGICAL_AXIS_RULES, MeshConfig, ModelConfig
from rlax_tpu.models import Transformer
from rlax_tpu.models.logprobs import chunk_length, logprob_head
from rlax_tpu.models.options import ForwardOptions
from rlax_tpu.sharding import build_mesh, logical_to_spec, use_mesh
from rlax_tpu.trainer.step import recompute

BATCH, SEQ, EMBED, VOCAB = 2, 13, 32, 300


def _inputs(tied: bool):
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (BATCH, SEQ, EMBED))
    w = 0.3 * jax.random.normal(k[1], (VOCAB, EMBED))
    targets = jax.random.randint(k[2], (BATCH, SEQ), 0, VOCAB)
    cot = jax.random.normal(k[3], (BATCH, SEQ)), jax.random.normal(k[4], (BATCH, SEQ))
    return h, (w if tied else w.T), targets, cot


def _todays_head(h, w, targets, *, tied, temperature, formula):
    """The head as forward_train / step.py computed it before chunking: whole logits, a
    gather of the target, then (step.entropy_from_logits) the entropy."""
    spec = "bse,ve->bsv" if tied else "bse,ev->bsv"
    logits = jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    if formula == "policy":
        lp = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0] - lse
    else:
        full = jax.nn.log_softmax(logits, axis=-1)
        lp = jnp.take_along_axis(full, targets[..., None], axis=-1)[..., 0]
    return lp, lse - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)


def _head(h, w, targets, *, tied, temperature, formula, chunk_size):
    out = logprob_head(
        h,
        w,
        targets,
        tied=tied,
        temperature=temperature,
        formula=formula,
        entropy=True,
        chunk_size=chunk_size,
    )
    return out.logprobs, out.entropies


def test_chunks_hold_every_rows_next_positions():
    assert chunk_length(batch=2, seq=13, chunk_size=10) == 5  # 3 chunks, 2 positions of padding
    assert chunk_length(batch=4, seq=13, chunk_size=2) == 1  # at least one position per row
    assert chunk_length(batch=2, seq=13, chunk_size=1000) == 13  # one chunk: unchunked


@pytest.mark.parametrize(
    "tied, formula, temperature",
    [
        (True, "policy", 0.7),
        (False, "inference", 0.7),
        (True, "inference", 1.0),
        (False, "policy", 1.0),
    ],
)
def test_chunked_logprobs_and_entropies_equal_unchunked(tied, formula, temperature):
    """Chunk size 0 is today's head, 10 holds 5 positions a row (13 padded to 15). The same
    math compiled in other fusions and, for small chunks, other XLA:CPU matmul kernels: a
    few f32 ULPs apart at most (bitwise for most tokens). An entropy sums a term per
    vocabulary entry, so its rounding differs by more ULPs than a log-prob's (4.8e-6 of
    4.1 measured on a 2-core AMD EPYC host)."""
    h, w, targets, _ = _inputs(tied)
    kw = dict(tied=tied, temperature=temperature, formula=formula)
    want_lp, want_ent = jax.jit(lambda h, w: _todays_head(h, w, targets, **kw))(h, w)
    for chunk_size in (0, 10):
        lp, ent = jax.jit(lambda h, w, c=chunk_size: _head(h, w, targets, **kw, chunk_size=c))(h, w)
        assert lp.shape == ent.shape == (BATCH, SEQ)
        np.testing.assert_allclose(lp, want_lp, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ent, want_ent, rtol=4e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("formula", ["policy", "inference"])
def test_gradients_through_chunked_head_equal_unchunked(tied, formula):
    h, w, targets, (a, c) = _inputs(tied)

    def loss(h, w, chunk_size):
        lp, ent = _head(
            h, w, targets, tied=tied, temperature=0.7, formula=formula, chunk_size=chunk_size
        )
        return jnp.sum(a * lp) + jnp.sum(c * ent)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    want_value, want = grad(h, w, 0)
    value, got = grad(h, w, 10)
    np.testing.assert_allclose(value, want_value, atol=1e-4)  # a sum of 26 terms ~ ±10
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(np.abs(r).max()))


def test_chunked_head_holds_one_chunks_logits_in_value_and_grad():
    """Compiled temporaries of value_and_grad (log-probs and entropies) fall with the chunk:
    the unchunked head holds several float32 [tokens, vocab] arrays, the chunked one a few
    [chunk, vocab]."""
    batch, seq, embed, vocab = 2, 512, 32, 8192
    shapes = (
        jax.ShapeDtypeStruct((batch, seq, embed), jnp.float32),
        jax.ShapeDtypeStruct((vocab, embed), jnp.float32),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
    )

    def temp_bytes(chunk_size):
        def loss(h, w, t):
            lp, ent = _head(
                h, w, t, tied=True, temperature=0.7, formula="policy", chunk_size=chunk_size
            )
            return jnp.sum(lp) + jnp.sum(ent)

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits_bytes = batch * seq * vocab * 4  # 32 MiB
    unchunked, chunked = temp_bytes(0), temp_bytes(64)
    assert unchunked > 2 * logits_bytes
    assert chunked < logits_bytes / 2 and chunked < unchunked / 8


# -- through the model ------------------------------------------------------------------------

CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    value_head=True,
)


@functools.cache
def _split(tied: bool = True) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph and weights, drawn with numpy (an eager init compiles dozens of
    small programs): norms, biases and the value head away from their trivial init."""
    config = dataclasses.replace(CONFIG, tie_word_embeddings=tied)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    return graphdef, jax.tree.map(
        lambda x: jnp.asarray((0.1 * rng.standard_normal(x.shape)).astype(x.dtype)), state
    )


def _model(tied: bool = True) -> Transformer:
    return nnx.merge(*_split(tied))


def _tokens():
    tokens = jax.random.randint(jax.random.key(7), (8, 12), 0, CONFIG.vocab_size)
    return tokens, jnp.roll(tokens, -1, axis=1)


def _forward(tied, tokens, targets, chunk_size, **kw):
    graphdef, state = _split(tied)
    options = ForwardOptions(logprob_chunk_size=chunk_size)

    @jax.jit
    def run(state):
        out = nnx.merge(graphdef, state).forward_train(tokens, targets, options=options, **kw)
        return out.logprobs, out.entropies, out.values

    return run(state)


def test_forward_train_runs_the_head_in_chunks_of_the_options_size():
    graphdef, state = _split()
    tokens, targets = _tokens()  # [8, 12]

    def scan_lengths(chunk_size, **kw):
        options = ForwardOptions(logprob_chunk_size=chunk_size)
        jaxpr = jax.make_jaxpr(
            lambda s: nnx.merge(graphdef, s).forward_train(tokens, targets, options=options, **kw)
        )(state)
        return [e.params["length"] for e in jaxpr.eqns if e.primitive.name == "scan"]

    assert 3 in scan_lengths(40)  # 5 positions of 8 rows a chunk: 3 chunks
    assert 6 in scan_lengths(16)  # 2 positions a chunk
    assert 3 not in scan_lengths(0)
    assert 3 not in scan_lengths(40, return_logits=True)  # whole logits: unchunked


@pytest.mark.parametrize("tied", [True, False])
def test_forward_train_chunked_equals_unchunked(tied):
    tokens, targets = _tokens()
    kw = dict(return_entropy=True, temperature=0.7, logprob_formula="inference")
    want = _forward(tied, tokens, targets, 0, **kw)
    got = _forward(tied, tokens, targets, 40, **kw)  # 5 positions a row: 3 chunks, padded
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[2], want[2])  # the value head is not chunked
    with_logits = _forward(tied, tokens, targets, 40, return_logits=True, **kw)
    np.testing.assert_array_equal(with_logits[0], want[0])


def test_recompute_with_chunked_head_equals_unchunked():
    graphdef, state = _split()
    params = nnx.to_pure_dict(state)
    tokens, _ = _tokens()

    def run(chunk_size):
        fn = jax.jit(
            lambda p: recompute(
                graphdef,
                p,
                tokens,
                micro_size=4,
                values=True,
                temperature=0.7,
                options=ForwardOptions(logprob_chunk_size=chunk_size),
            )
        )
        return fn(params)

    want, got = run(0), run(16)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got.values, want.values)


def _sharded_loss_and_grad(targets, cot, chunk_size):
    def loss(h, w):
        lp, ent = _head(
            h, w, targets, tied=True, temperature=0.7, formula="policy", chunk_size=chunk_size
        )
        return jnp.sum(cot[0] * lp) + jnp.sum(cot[1] * ent), (lp, ent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _has_whole_vocab_logits(hlo: str) -> bool:
    return re.search(r"f32\[\d+,\d+,320\]", hlo) is not None


@pytest.mark.parametrize("data, fsdp, tensor", [(2, 2, 2), (2, 1, 4)])
def test_sharded_chunked_head_equals_single_device_unchunked(data, fsdp, tensor):
    """On 8 virtual CPU devices — hidden states split over the batch axes, the tied
    embedding by its logical axes (vocab over tensor, embed over fsdp) — the chunked head's
    log-probs, entropies and gradients are the single-device unchunked ones."""
    assert len(jax.devices()) == 8, "conftest must give JAX 8 virtual CPU devices"
    rows = 4  # divisible by data × fsdp
    h, w, targets, cot = _inputs(True)
    h, targets = jnp.tile(h, (2, 1, 1))[:rows], jnp.tile(targets, (2, 1))[:rows]
    cot = tuple(jnp.tile(c, (2, 1))[:rows] for c in cot)
    w = jnp.pad(w, ((0, 320 - VOCAB), (0, 0)))  # a vocab the tensor axis divides
    with jax.default_device(jax.devices()[0]):
        reference = _sharded_loss_and_grad(targets, cot, 0)
        (want_value, want_out), want_grads = reference(h, w)
        assert _has_whole_vocab_logits(reference.lower(h, w).compile().as_text())
    mesh = build_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    rules = DEFAULT_LOGICAL_AXIS_RULES
    h = jax.device_put(
        h, NamedSharding(mesh, logical_to_spec(("batch", "length", "act_embed"), rules))
    )
    w = jax.device_put(w, NamedSharding(mesh, logical_to_spec(("vocab", "embed"), rules)))
    with use_mesh(mesh, rules):
        chunked = _sharded_loss_and_grad(targets, cot, 12)  # 3 positions a row, padded
        (value, out), grads = chunked(h, w)
        # Each device's logits are of its part of the vocab, in the forward and the backward.
        assert not _has_whole_vocab_logits(chunked.lower(h, w).compile().as_text())
    np.testing.assert_allclose(value, want_value, atol=1e-4)
    for x, r in zip(out, want_out, strict=True):  # fsdp splits the logits' contraction too
        np.testing.assert_allclose(x, r, rtol=0, atol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        # Reduction order differs across shardings: compare relative to each leaf's scale.
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(np.abs(r).max()))


def test_negative_chunk_size_is_refused():
    h, w, targets, _ = _inputs(True)
    with pytest.raises(ValueError, match="chunk_size must be >= 0"):
        logprob_head(h, w, targets, tied=True, chunk_size=-1)


def test_unknown_formula_is_refused():
    h, w, targets, _ = _inputs(True)
    with pytest.raises(ValueError, match="'inference', 'policy'"):
        logprob_head(h, w, targets, tied=True, formula="sampled", chunk_size=4)
