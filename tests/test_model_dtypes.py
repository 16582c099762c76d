"""Precision: a model with bfloat16 params and compute holds bf16 weights, runs every matmul
on bf16 operands, and still returns float32 log-probs close to the float32 model's with the
same weights, and a finite gradient."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tpu.config import ModelConfig
from rlax_tpu.models import Transformer
from rlax_tpu.models.hf import build_model

F32 = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    qk_norm=True,
)
BF16 = dataclasses.replace(F32, param_dtype="bfloat16", dtype="bfloat16")


@functools.cache  # building a Transformer eagerly takes seconds; the tests only read them
def _models() -> tuple[Transformer, Transformer]:
    """The same weights in a float32 and a bfloat16 model. The weights are exactly
    representable in bf16 (norms and biases moved off their init), so any difference between
    the two models' outputs comes from the precision of the computation alone."""
    params = nnx.to_pure_dict(nnx.state(Transformer(F32, rngs=nnx.Rngs(0)), nnx.Param))
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
    params = jax.tree.map(
        lambda x: (
            (x + 0.02 * jax.random.normal(next(keys), x.shape))
            .astype(jnp.bfloat16)
            .astype(jnp.float32)
        ),
        params,
    )
    return (
        build_model(F32, params, rngs=nnx.Rngs(0)),
        build_model(BF16, params, rngs=nnx.Rngs(0)),
    )


def _batch() -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, F32.vocab_size)
    return tokens, jnp.roll(tokens, -1, axis=1)


def _matmul_operand_dtypes(model: Transformer, tokens, targets) -> list[tuple[str, ...]]:
    """The operand dtypes of every dot_general in forward_train's jaxpr (nested ones too)."""
    graphdef, state = nnx.split(model)
    closed = jax.make_jaxpr(
        lambda s: nnx.merge(graphdef, s).forward_train(tokens, targets).logprobs
    )(state)
    found: list[tuple[str, ...]] = []

    def walk(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return found


def test_bfloat16_model_holds_bfloat16_params_and_activations():
    _, model = _models()
    params = jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
    tokens, targets = _batch()
    assert model.hidden_states(tokens).dtype == jnp.bfloat16
    out = model.forward_train(tokens, targets, return_logits=True)
    # Logits and log-probs are float32 whatever the compute dtype.
    assert out.logits.dtype == jnp.float32 and out.logprobs.dtype == jnp.float32


def test_bfloat16_model_runs_every_matmul_in_bfloat16():
    f32_model, bf16_model = _models()
    tokens, targets = _batch()
    bf16_dots = _matmul_operand_dtypes(bf16_model, tokens, targets)
    # q, k, v, scores, mix, out, gate, up, down per layer, then the LM head.
    assert len(bf16_dots) >= 9 * BF16.num_layers + 1
    assert set(bf16_dots) == {("bfloat16", "bfloat16")}
    # The walk sees float32 matmuls where there are some (it is not vacuous).
    assert set(_matmul_operand_dtypes(f32_model, tokens, targets)) == {("float32", "float32")}


def test_bfloat16_forward_matches_float32_with_the_same_weights():
    f32_model, bf16_model = _models()
    tokens, targets = _batch()
    expected = np.asarray(f32_model.forward_train(tokens, targets).logprobs)
    got = np.asarray(bf16_model.forward_train(tokens, targets).logprobs)
    assert got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=2e-2)
    # Same weights, so only bf16 arithmetic can make them differ: a model that silently
    # computed in float32 would match to the last bit.
    assert np.abs(got - expected).max() > 1e-4


def test_bfloat16_gradient_is_finite_and_points_like_the_float32_one():
    tokens, targets = _batch()

    def grad(model: Transformer) -> tuple[list, np.ndarray]:
        graphdef, state = nnx.split(model)

        def loss(s):
            return -nnx.merge(graphdef, s).forward_train(tokens, targets).logprobs.mean()

        leaves = jax.tree.leaves(jax.jit(jax.grad(loss))(state))
        flat = np.concatenate([np.asarray(g, np.float32).ravel() for g in leaves])
        return leaves, flat

    f32_model, bf16_model = _models()
    bf16_leaves, bf16_grad = grad(bf16_model)
    _, f32_grad = grad(f32_model)
    assert {g.dtype for g in bf16_leaves} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(bf16_grad).all() and np.abs(bf16_grad).max() > 0
    cosine = bf16_grad @ f32_grad / (np.linalg.norm(bf16_grad) * np.linalg.norm(f32_grad))
    assert cosine > 0.99
