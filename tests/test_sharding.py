"""Sharded forward and gradient equal the single-device result on 8 virtual CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from rlax_tpu.config import DEFAULT_LOGICAL_AXIS_RULES, ConfigError, MeshConfig, ModelConfig
from rlax_tpu.models import Transformer
from rlax_tpu.sharding import build_mesh, logical_to_spec, shard_model, use_mesh

RULES = DEFAULT_LOGICAL_AXIS_RULES
CONFIG = ModelConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
    qk_norm=True,
    value_head=True,
)


def _perturbed_model():
    """A model whose norms, biases and value head are not at their (trivial) init."""
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    nnx.update(
        model,
        jax.tree.map(
            lambda x: x + 0.1 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), nnx.state(model)
        ),
    )
    return model


def _batch():
    key = jax.random.key(7)
    tokens = jax.random.randint(key, (8, 12), 0, CONFIG.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    # Two packed sequences in some rows and padding at the end of others.
    segment_ids = jnp.ones((8, 12), jnp.int32).at[::2, 7:].set(2).at[1::2, 10:].set(0)
    weights = jax.random.uniform(jax.random.key(8), (8, 12))
    return tokens, targets, segment_ids, weights


def _loss_and_grad(model, tokens, targets, segment_ids, weights):
    graphdef, state = nnx.split(model)

    def loss(state):
        out = nnx.merge(graphdef, state).forward_train(tokens, targets, segment_ids=segment_ids)
        return jnp.sum(out.logprobs * weights) + jnp.sum(out.values * weights), out.logprobs

    (value, logprobs), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return value, logprobs, grads


@pytest.fixture(scope="module")
def reference():
    model = _perturbed_model()
    with jax.default_device(jax.devices()[0]):
        return _loss_and_grad(model, *_batch())


@pytest.mark.parametrize("data, fsdp, tensor", [(2, 2, 2), (1, 8, 1), (1, 2, 4), (8, 1, 1)])
def test_sharded_forward_and_gradient_equal_single_device(reference, data, fsdp, tensor):
    assert len(jax.devices()) == 8, "conftest must give JAX 8 virtual CPU devices"
    model = _perturbed_model()
    mesh = build_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))
    shard_model(model, mesh, RULES)
    with use_mesh(mesh, RULES):
        value, logprobs, grads = _loss_and_grad(model, *_batch())
    ref_value, ref_logprobs, ref_grads = reference
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)
    flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for g, r in zip(flat, ref_flat, strict=True):
        # Reduction order differs across shardings: compare relative to each leaf's scale.
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(np.abs(r).max()))


def test_parameters_are_placed_by_their_logical_axes():
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shard_model(model, mesh, RULES)
    wq = model.layers[0].attn.wq.get_value()
    assert wq.sharding == NamedSharding(mesh, PartitionSpec("fsdp", "tensor", None))
    embed = model.embed.get_value()
    assert embed.sharding == NamedSharding(mesh, PartitionSpec("tensor", "fsdp"))
    # Each device holds a quarter of wq: fsdp halves `embed`, tensor halves `heads`.
    assert wq.addressable_shards[0].data.shape == (16, 2, 8)


def test_mesh_axis_is_used_once_per_array():
    rules = (("a", ("fsdp",)), ("b", ("fsdp", "tensor")))
    assert logical_to_spec(("a", "b"), rules) == PartitionSpec("fsdp", "tensor")


def test_axis_that_does_not_divide_a_dimension_is_replicated():
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    spec = logical_to_spec(("embed", "kv_heads", "head_dim"), RULES, shape=(32, 2, 8), mesh=mesh)
    assert spec == PartitionSpec("fsdp", None, None)


def test_logical_axis_without_a_rule_is_an_error_naming_it():
    with pytest.raises(KeyError, match="'experts' has no rule"):
        logical_to_spec(("experts",), RULES)


def test_mesh_uses_every_device_in_the_configured_shape():
    mesh = build_mesh(MeshConfig(data=2, fsdp=-1, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_one_slice_keeps_the_devices_in_their_order():
    mesh = build_mesh(MeshConfig(data=2, fsdp=-1, tensor=2, dcn_axis="fsdp"))
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()]


def test_a_multi_slice_mesh_over_devices_of_one_slice_is_refused_naming_both_counts():
    # CPU devices have no slice_index: each process counts as a slice, and this is one.
    with pytest.raises(ConfigError, match=r"num_slices=2 .* lie in 1 processes \(cpu"):
        build_mesh(MeshConfig(data=2, fsdp=-1, tensor=2, num_slices=2))
