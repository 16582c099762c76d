"""Hugging Face import/export (rlax_tpu.models.hf) against transformers itself.

Tiny random Llama 3 / Qwen2 / Qwen3 models are saved by transformers, imported, and must
give the same logits (full forward and KV-cached decode); exported checkpoints must load
back bit-exactly and in transformers; bad checkpoints fail naming the tensor at fault.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from hf_fixtures import ARCHITECTURES, HF_CONFIGS, VOCAB, make_hf_model

from rlax_tpu import storage
from rlax_tpu.config import ModelConfig
from rlax_tpu.models import DenseKVCache, Transformer, hf

TOLERANCE = 1e-4
PROMPT_LENGTHS = (1, 6, 23)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def saved(request, tmp_path_factory):
    """(architecture, torch model, directory it was saved to by transformers)."""
    arch = request.param
    model = make_hf_model(arch, seed=ARCHITECTURES.index(arch))
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return arch, model, str(path)


@pytest.fixture(scope="module")
def imported(saved):
    _, _, path = saved
    return hf.load_hf_model(path)


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=n).astype(np.int32) for n in lengths]


@torch.no_grad()
def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32[seq, vocab] for one unpadded sequence."""
    return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_trees_identical(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


# -- import: config and logits ----------------------------------------------------------------


def test_config_is_read_from_config_json(saved, imported):
    arch, model, _ = saved
    c, hc = imported.config, model.config
    assert c.architecture == arch
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (
        hc.hidden_size,
        hc.num_hidden_layers,
        hc.num_attention_heads,
        hc.num_key_value_heads,
        hc.vocab_size,
    )
    assert c.head_dim == getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert c.tie_word_embeddings == hc.tie_word_embeddings
    assert c.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert c.qk_norm == (arch == "Qwen3ForCausalLM")
    assert (c.rope_scaling is not None) == (arch == "LlamaForCausalLM")
    assert c.rms_norm_eps == hc.rms_norm_eps


@nnx.jit
def _logits(model: Transformer, tokens: jax.Array) -> jax.Array:
    return model.forward_train(tokens, tokens, return_logits=True).logits


@nnx.jit
def _prefill(model, tokens, positions, valid, cache, last):
    return model.decode(tokens, positions, valid, cache, logits_index=last)


@nnx.jit
def _step(model, tokens, positions, cache):
    return model.decode(tokens, positions, jnp.ones(tokens.shape, bool), cache)


def _assert_logits_match(model: Transformer, hf_model, prompts) -> None:
    """Prompts of different lengths, right-padded into one batch (causal attention keeps the
    padding out of every real position), against transformers one prompt at a time."""
    width = max(len(p) for p in prompts)
    batch = np.zeros((len(prompts), width), np.int32)
    for row, tokens in enumerate(prompts):
        batch[row, : len(tokens)] = tokens
    logits = np.asarray(_logits(model, jnp.asarray(batch)))
    for row, tokens in enumerate(prompts):
        expected = _hf_logits(hf_model, tokens)
        np.testing.assert_allclose(logits[row, : len(tokens)], expected, rtol=0, atol=TOLERANCE)


def test_logits_match_transformers(saved, imported):
    _, model, _ = saved
    _assert_logits_match(imported, model, _prompts(PROMPT_LENGTHS))


def test_kv_cached_decode_matches_transformers(saved, imported):
    """Prefill two prompts of different lengths (right-padded) then decode step by step;
    every step's logits equal transformers' full forward at that position."""
    _, model, _ = saved
    c = imported.config
    prompt_lengths, steps = (9, 4), 5
    sequences = _prompts([n + steps for n in prompt_lengths], seed=1)
    expected = [_hf_logits(model, s) for s in sequences]
    width = max(prompt_lengths)
    tokens = np.zeros((2, width), np.int32)
    for row, (seq, n) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        tokens[row, :n] = seq[:n]
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), (2, width))
    valid = positions < np.array(prompt_lengths)[:, None]
    cache = DenseKVCache.create(
        num_layers=c.num_layers,
        batch=2,
        max_len=32,
        kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        dtype=jnp.float32,
    )
    last = jnp.asarray(np.array(prompt_lengths) - 1, jnp.int32)
    logits, cache = _prefill(
        imported, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(valid), cache, last
    )
    for row, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(logits[row], expected[row][n - 1], rtol=0, atol=TOLERANCE)
    for step in range(steps):
        pos = np.array(prompt_lengths, np.int32) + step
        tok = np.array([sequences[r][pos[r]] for r in range(2)], np.int32)
        logits, cache = _step(imported, jnp.asarray(tok[:, None]), jnp.asarray(pos[:, None]), cache)
        for row in range(2):
            np.testing.assert_allclose(
                logits[row, 0], expected[row][pos[row]], rtol=0, atol=TOLERANCE
            )


def test_sharded_checkpoint_loads_same_weights(saved, imported, tmp_path):
    _, model, _ = saved
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / hf.INDEX_FILE).exists() and not (tmp_path / hf.SAFETENSORS_FILE).exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    _assert_trees_identical(_params(hf.load_hf_model(str(tmp_path))), _params(imported))


def _llama_json(**changes) -> dict:
    config = {**HF_CONFIGS["LlamaForCausalLM"]().to_dict(), "architectures": ["LlamaForCausalLM"]}
    return {**config, **changes}


def test_v4_rope_layout_reads_like_v5():
    v5 = hf.config_from_hf_dict(_llama_json())
    v4_json = _llama_json(rope_theta=500.0)
    scaling = {k: v for k, v in v4_json.pop("rope_parameters").items() if k != "rope_theta"}
    v4_json["rope_scaling"] = {**scaling, "type": scaling.pop("rope_type")}
    assert hf.config_from_hf_dict(v4_json) == v5
    assert v5.rope_theta == 500.0 and v5.rope_scaling.type == "llama3"
    assert v5.rope_scaling.original_max_position_embeddings == 32


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "MistralForCausalLM"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "gelu"),
    ],
)
def test_unsupported_config_is_rejected_naming_the_setting(changes, named):
    with pytest.raises(hf.UnsupportedCheckpointError, match=named):
        hf.config_from_hf_dict(_llama_json(**changes))


def test_linear_and_default_rope_types_are_read():
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    config = hf.config_from_hf_dict(_llama_json(rope_parameters=linear))
    assert (config.rope_scaling.type, config.rope_scaling.factor) == ("linear", 2.0)
    default = {"rope_type": "default", "rope_theta": 500.0}
    assert hf.config_from_hf_dict(_llama_json(rope_parameters=default)).rope_scaling is None


def test_directory_without_checkpoint_files_is_reported(tmp_path):
    with pytest.raises(hf.CheckpointError, match="config.json"):
        hf.load_hf_config(str(tmp_path))
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(_llama_json()))
    with pytest.raises(hf.CheckpointError, match="model.safetensors"):
        hf.load_hf_model(str(tmp_path))


def test_config_overrides_apply(saved):
    _, _, path = saved
    config = hf.load_hf_config(path, param_dtype="bfloat16", value_head=True)
    assert (config.param_dtype, config.value_head, config.hf_checkpoint) == ("bfloat16", True, path)


# -- export ---------------------------------------------------------------------------------


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("max_shard_bytes", [hf.DEFAULT_MAX_SHARD_BYTES, 30_000])
def test_export_then_import_is_bit_exact(saved, tmp_path, param_dtype, max_shard_bytes):
    _, _, path = saved
    model = hf.load_hf_model(path, param_dtype=param_dtype)
    hf.save_hf(model, model.config, str(tmp_path), max_shard_bytes=max_shard_bytes)
    sharded = max_shard_bytes < hf.DEFAULT_MAX_SHARD_BYTES
    assert (tmp_path / hf.INDEX_FILE).exists() == sharded
    assert (tmp_path / hf.SAFETENSORS_FILE).exists() != sharded
    config = hf.load_hf_config(str(tmp_path))
    assert dataclasses.replace(config, hf_checkpoint=path) == model.config
    reloaded = hf.load_hf_params(str(tmp_path), config)
    _assert_trees_identical(reloaded, _params(model))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_exported_model_loads_in_transformers(arch, tmp_path):
    """A model that never came from transformers (random rlax params, norms and biases
    included) exports to a checkpoint that transformers runs with the same logits."""
    config = hf.config_from_hf_dict({**HF_CONFIGS[arch]().to_dict(), "architectures": [arch]})
    model = Transformer(config, rngs=nnx.Rngs(0))
    params = _params(model)
    keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
    noisy = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), params)
    nnx.update(model, noisy)
    hf.save_hf(model, config, str(tmp_path))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(hf_model).__name__ == arch
    _assert_logits_match(model, hf_model, _prompts((5, 17), seed=2))


@pytest.mark.parametrize(
    ("architecture", "changes"),
    [
        ("LlamaForCausalLM", {"qkv_bias": True}),
        ("Qwen2ForCausalLM", {"qkv_bias": False}),
        ("Qwen3ForCausalLM", {"qk_norm": False}),
        ("LlamaForCausalLM", {"qk_norm": True}),
    ],
)
def test_export_refuses_configs_transformers_cannot_express(architecture, changes, tmp_path):
    config = ModelConfig(architecture=architecture, qk_norm=architecture == "Qwen3ForCausalLM")
    config = dataclasses.replace(config, **changes)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    with pytest.raises(hf.UnsupportedCheckpointError, match=architecture):
        hf.save_hf(model, config, str(tmp_path))
    assert not list(tmp_path.iterdir())


def test_value_head_round_trips_only_when_asked(saved, tmp_path):
    _, _, path = saved
    model = hf.load_hf_model(path, value_head=True)
    assert not np.any(np.asarray(model.value_w.get_value()))  # initialised, not from HF
    nnx.update(model, {"value_w": jnp.full(model.value_w.shape, 0.5), "value_b": jnp.array(2.0)})
    hf.save_hf(model, model.config, str(tmp_path / "plain"))
    hf.save_hf(model, model.config, str(tmp_path / "with_head"), include_value_head=True)
    plain = hf.load_hf_model(str(tmp_path / "plain"), value_head=True)
    assert not np.any(np.asarray(plain.value_w.get_value()))
    with_head = hf.load_hf_model(str(tmp_path / "with_head"), value_head=True)
    _assert_trees_identical(_params(with_head), _params(model))
    # The extra tensors do not stop a value-head-free import.
    hf.load_hf_model(str(tmp_path / "with_head"))


# -- gs:// ---------------------------------------------------------------------------------


def test_import_and_export_through_gcs(saved, imported, tmp_path, gcs_bucket):
    _, model, _ = saved
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    remote = storage.join(gcs_bucket, "checkpoints", "policy")
    storage.copy_tree(str(tmp_path), remote)
    from_gcs = hf.load_hf_model(remote)
    _assert_trees_identical(_params(from_gcs), _params(imported))
    exported = storage.join(gcs_bucket, "exported")
    hf.save_hf(from_gcs, from_gcs.config, exported)
    config = hf.load_hf_config(exported)
    _assert_trees_identical(hf.load_hf_params(exported, config), _params(imported))


# -- bad checkpoints ------------------------------------------------------------------------


def _rewrite_checkpoint(src: str, dst, edit) -> str:
    """Copy the single-file checkpoint at `src` to `dst` with its tensors passed through `edit`."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, hf.CONFIG_FILE)) as f:
        config = f.read()
    with open(os.path.join(dst, hf.CONFIG_FILE), "w") as f:
        f.write(config)
    tensors = safetensors.numpy.load_file(os.path.join(src, hf.SAFETENSORS_FILE))
    edit(tensors)
    safetensors.numpy.save_file(
        tensors, os.path.join(dst, hf.SAFETENSORS_FILE), metadata={"format": "pt"}
    )
    return str(dst)


def test_missing_tensor_is_named(saved, tmp_path):
    _, _, path = saved
    name = "model.layers.1.mlp.up_proj.weight"
    bad = _rewrite_checkpoint(path, tmp_path, lambda t: t.pop(name))
    with pytest.raises(hf.CheckpointMismatchError, match=rf"{name}.*missing.*{bad}"):
        hf.load_hf_model(bad)


def test_wrong_shape_is_named_with_both_shapes_and_file(saved, tmp_path):
    _, _, path = saved
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1]

    bad = _rewrite_checkpoint(path, tmp_path, shrink)
    with pytest.raises(hf.CheckpointMismatchError) as err:
        hf.load_hf_model(bad)
    message = str(err.value)
    expected = [2 * hf.load_hf_config(path).head_dim, 64]
    assert name in message and hf.SAFETENSORS_FILE in message
    assert str(expected) in message and str([expected[0] - 1, 64]) in message


def test_unexpected_tensor_is_rejected_but_rotary_tables_are_ignored(saved, tmp_path):
    _, _, path = saved

    def add_rotary(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    hf.load_hf_model(_rewrite_checkpoint(path, tmp_path / "rotary", add_rotary))

    def add_stray(tensors):
        tensors["model.layers.0.mlp.gate_proj.bias"] = np.ones(96, np.float32)

    bad = _rewrite_checkpoint(path, tmp_path / "stray", add_stray)
    with pytest.raises(hf.CheckpointMismatchError, match=r"unexpected.*gate_proj\.bias"):
        hf.load_hf_model(bad)


def test_non_float_tensor_is_a_dtype_mismatch(saved, tmp_path):
    _, _, path = saved
    name = "model.norm.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].astype(np.int32)

    bad = _rewrite_checkpoint(path, tmp_path, to_int)
    with pytest.raises(hf.CheckpointMismatchError, match=rf"{name}.*dtype I32"):
        hf.load_hf_model(bad)


def test_bfloat16_checkpoint_loads_as_bfloat16(saved, imported, tmp_path):
    _, _, path = saved

    def to_bf16(tensors):
        for k in tensors:
            tensors[k] = tensors[k].astype(ml_dtypes.bfloat16)

    bf16_dir = _rewrite_checkpoint(path, tmp_path, to_bf16)
    config = json.loads((tmp_path / hf.CONFIG_FILE).read_text())
    config["dtype"] = "bfloat16"
    (tmp_path / hf.CONFIG_FILE).write_text(json.dumps(config))
    model = hf.load_hf_model(bf16_dir)
    assert model.config.param_dtype == "bfloat16"
    assert model.embed.get_value().dtype == jnp.bfloat16
    expected = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params(imported))
    _assert_trees_identical(_params(model), expected)
