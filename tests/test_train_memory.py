"""The training forward's memory features: scanned layers, remat policies and the attention
backends give the reference's numbers, and on a TPU compile the temporaries fall."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from rlax_tpu.config import MeshConfig, ModelConfig
from rlax_tpu.models.attention import (
    dot_product_attention,
    reference_attention,
    splash_attention,
)
from rlax_tpu.models.options import ForwardOptions, resolve_train_attention
from rlax_tpu.models.transformer import (
    Transformer,
    is_stacked,
    stack_layers,
    unstack_layers,
)
from rlax_tpu.sharding import build_mesh, logical_to_spec, state_shardings, use_mesh

CONFIG = ModelConfig(num_layers=3, qkv_bias=True, qk_norm=True)


def _params(scan: bool):
    model = Transformer(CONFIG, rngs=nnx.Rngs(0), scan_layers=scan)
    return nnx.split(model, nnx.Param)


def _loss_and_grads(graphdef, state, tokens, options):
    def loss(s):
        return jnp.sum(
            nnx.merge(graphdef, s).forward_train(tokens, tokens, options=options).logprobs
        )

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return float(value), unstack_layers(nnx.to_pure_dict(grads))


def _max_diff(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y))), a, b)))


def test_scanned_layers_hold_the_per_layer_values_stacked():
    _, per_layer = _params(scan=False)
    _, scanned = _params(scan=True)
    per_layer, scanned = nnx.to_pure_dict(per_layer), nnx.to_pure_dict(scanned)
    assert is_stacked(scanned) and not is_stacked(per_layer)
    assert scanned["layers"]["attn"]["wq"].shape == (3, *per_layer["layers"][0]["attn"]["wq"].shape)
    jax.tree.map(np.testing.assert_array_equal, unstack_layers(scanned), per_layer)
    jax.tree.map(np.testing.assert_array_equal, stack_layers(per_layer), scanned)
    # Either conversion leaves a tree already in its format as it is.
    assert unstack_layers(per_layer).keys() == per_layer.keys()
    assert stack_layers(scanned)["layers"]["mlp"]["w_up"].shape[0] == 3


def test_scan_and_remat_keep_the_loss_and_gradients():
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, CONFIG.vocab_size)
    ref_value, ref_grads = _loss_and_grads(*_params(False), tokens, ForwardOptions())
    options = ForwardOptions(remat_policy="save_dot_except_mlp")
    value, grads = _loss_and_grads(*_params(True), tokens, options)
    assert value == pytest.approx(ref_value, rel=1e-6)
    assert _max_diff(grads, ref_grads) < 1e-5


def test_unknown_remat_policy_is_named():
    graphdef, state = _params(False)
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="remat_policy 'most'.*'full'"):
        nnx.merge(graphdef, state).forward_train(
            tokens, tokens, options=ForwardOptions(remat_policy="most")
        )


def _qkv(seq: int, *, heads=4, kv_heads=2, d=16, batch=2):
    ks = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(ks[0], (batch, seq, heads, d))
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, d))
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, d))
    return q, k, v


def _segments(batch: int, seq: int) -> jax.Array:
    """Two packed sequences then padding (id 0) in every row."""
    ids = np.zeros((batch, seq), np.int32)
    ids[:, : seq // 2] = 1
    ids[:, seq // 2 : seq - 7] = 2
    return jnp.asarray(ids)


@pytest.mark.parametrize("attention", [splash_attention, dot_product_attention])
def test_attention_backends_match_the_reference(attention):
    """Forward and gradient, causal and with packed segments plus padding; a length that
    is not a multiple of the splash block (padded inside)."""
    q, k, v = _qkv(150)
    for segment_ids in (_segments(2, 150),):
        real = jnp.ones((2, 150)) if segment_ids is None else (segment_ids != 0).astype(float)
        weights = real[:, :, None, None] * jnp.cos(jnp.arange(16.0))

        def loss(fn, segment_ids=segment_ids, weights=weights):
            return lambda q, k, v: jnp.sum(fn(q, k, v, segment_ids) * weights)

        got = jax.jit(attention)(q, k, v, segment_ids)
        want = reference_attention(q, k, v, segment_ids)
        mask = np.asarray(real, bool)
        np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=2e-6)
        got_g = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k, v)
        want_g = jax.grad(loss(reference_attention), argnums=(0, 1, 2))(q, k, v)
        assert _max_diff(got_g, want_g) < 2e-5


def test_splash_under_a_mesh_matches_the_reference():
    """shard_map over batch (data × fsdp) and kv heads (tensor) on 8 CPU devices."""
    mesh_config = MeshConfig(data=2, fsdp=2, tensor=2)
    mesh = build_mesh(mesh_config, jax.devices()[:8])
    q, k, v = _qkv(128, batch=4)
    with use_mesh(mesh, mesh_config.logical_axis_rules):
        got = jax.jit(splash_attention)(q, k, v)
    np.testing.assert_allclose(got, reference_attention(q, k, v), atol=2e-6)


def test_auto_attention_resolves_by_platform():
    assert resolve_train_attention("auto", platform="tpu") == "splash"
    assert resolve_train_attention("auto", platform="gpu") == "dot_product"
    assert resolve_train_attention("auto", platform="cpu") == "reference"
    assert resolve_train_attention("pallas", platform="cpu") == "splash"
    assert resolve_train_attention("jax", platform="tpu") == "reference"


def _tpu_devices(monkeypatch, topology: str):
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices


@pytest.mark.slow  # ~24 s; TPU compiles of the tiny model stay in tests/test_compile.py
def test_tpu_compile_of_scanned_remat_splash_training_fits_in_less(monkeypatch):
    """A small model's gradient compiled by libtpu for v5p:2x2x1 with scanned layers and
    splash attention: temporaries with remat "full" are well below those without."""
    config = ModelConfig(
        num_layers=2,
        hidden_size=256,
        intermediate_size=1024,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        vocab_size=512,
        dtype="bfloat16",
    )
    mesh_config = MeshConfig(fsdp=2, tensor=2)
    rules = mesh_config.logical_axis_rules
    mesh = build_mesh(mesh_config, _tpu_devices(monkeypatch, "v5p:2x2x1"))
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), scan_layers=True))
    graphdef, state = nnx.split(abstract, nnx.Param)
    params = jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
        nnx.to_pure_dict(state),
        nnx.to_pure_dict(state_shardings(state, mesh, rules)),
    )
    shape = (8, 512)
    spec = logical_to_spec(("batch", "length"), rules, shape=shape, mesh=mesh)
    tokens = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=NamedSharding(mesh, spec))

    def temporaries(policy: str) -> int:
        options = ForwardOptions(remat_policy=policy, attention="splash")

        def grads(p, t):
            def loss(p):
                return nnx.merge(graphdef, p).forward_train(t, t, options=options).logprobs.sum()

            return jax.grad(loss)(p)

        with use_mesh(mesh, rules):
            compiled = jax.jit(grads).lower(params, tokens).compile()
        text = compiled.as_text()
        assert "tpu_custom_call" in text  # the splash kernels, compiled by Mosaic
        return compiled.memory_analysis().temp_size_in_bytes

    kept, rematerialised = temporaries("none"), temporaries("full")
    assert rematerialised < 0.5 * kept, (rematerialised, kept)


@pytest.mark.slow  # ~30 s (two trainers compile); the default suite is at its budget
def test_a_scanning_remat_trainer_trains_and_publishes_like_the_reference(tmp_path):
    """Trainer with scan_layers, remat "full", splash attention and a chunked head on a
    2 × 2 × 2 mesh: one RL step gives the reference trainer's params, and what it hands out
    (`params()`, the published tree) is per layer."""
    from trainer_helpers import assert_trees_close, rollout_batch, run_config

    from rlax_tpu.trainer import Trainer

    reference = Trainer(run_config(str(tmp_path / "a"), micro=4))
    memory = Trainer(
        run_config(
            str(tmp_path / "b"),
            micro=4,
            scan_layers=True,
            remat_policy="full",
            attention_backend="pallas",
            logprob_chunk_size=16,
        )
    )
    assert memory.forward_options.attention == "splash"
    results = []
    for trainer in (reference, memory):
        trainer.initialize()
        results.append(trainer.train_step(0, rollout_batch()).metrics)
    assert results[1]["loss"] == pytest.approx(results[0]["loss"], rel=1e-5, abs=1e-7)
    assert is_stacked(memory._params)
    published = memory._published_params()
    assert not is_stacked(published) and not is_stacked(memory.params())
    # Adam at lr 1e-2 turns float32 rounding in a near-zero gradient into up to ~2e-5.
    assert_trees_close(memory.params(), reference.params(), rtol=1e-4, atol=5e-5)
    jax.tree.map(np.testing.assert_array_equal, published, memory.params())


def test_a_scanning_trainer_loads_an_hf_checkpoint_stacked_and_hands_it_out_per_layer(tmp_path):
    """HF import stacks the per-layer checkpoint for trainer.scan_layers; `params()` and HF
    export give back exactly the checkpoint's per-layer tree."""
    import dataclasses

    from trainer_helpers import MODEL, run_config

    from rlax_tpu.models.hf import load_hf_params, save_hf
    from rlax_tpu.trainer import Trainer

    per_layer = nnx.to_pure_dict(nnx.state(Transformer(MODEL, rngs=nnx.Rngs(5)), nnx.Param))
    save_hf(per_layer, MODEL, str(tmp_path / "hf"))
    config = run_config(str(tmp_path / "run"), scan_layers=True)
    config = dataclasses.replace(
        config, model=dataclasses.replace(MODEL, hf_checkpoint=str(tmp_path / "hf"))
    )
    trainer = Trainer(config)
    trainer.initialize()
    assert is_stacked(trainer._params)
    jax.tree.map(np.testing.assert_array_equal, trainer.params(), per_layer)
    save_hf(trainer._params, MODEL, str(tmp_path / "out"))  # export unstacks a stacked tree
    jax.tree.map(
        np.testing.assert_array_equal, load_hf_params(str(tmp_path / "out"), MODEL), per_layer
    )
