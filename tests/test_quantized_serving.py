"""Quantized serving (`inference.weight_dtype`): the per-channel round trip, an int8 / fp8
engine's behaviour log-probs against the trainer's recompute from the unquantized weights,
the mismatch metric that shows it, the default serving the published weights unchanged, the
memory, and LoRA adapters on a quantized base."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlax_tpu.config import InferenceConfig, LoraConfig, MeshConfig, ModelConfig
from rlax_tpu.config.run import LORA_TARGETS
from rlax_tpu.controller.assembly import rollout_rows
from rlax_tpu.inference.engine import Engine, GenerationRequest
from rlax_tpu.inference.sampling import SamplingParams
from rlax_tpu.models import Transformer, quantization
from rlax_tpu.sharding import build_mesh
from rlax_tpu.trainer.step import mismatch_metrics, recompute_logprobs

MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_heads=4, head_dim=8)
PROMPT, NEW, ROWS = 8, 16, 8
INFERENCE = InferenceConfig(
    max_decode_slots=ROWS,
    prefill_batch_size=ROWS,
    page_size=8,
    prefill_buckets=(PROMPT,),
    max_prompt_len=PROMPT,
    max_new_tokens=NEW,
    kv_cache_bytes=2**20,
)
# The largest |behaviour log-prob − the trainer's recompute from the unquantized weights| of
# a token (float32 compute, random init N(0, 0.02²), temperature 1), about twice the largest
# measured over three seeds of this model: int8 9.6e-4, fp8 4.7e-3 (docs/inference.md,
# "Quantized serving", has the bigger models' figures).
BOUND = {"int8": 2e-3, "fp8": 1e-2}


def _params(model: ModelConfig, seed: int = 0) -> dict:
    return nnx.to_pure_dict(nnx.state(Transformer(model, rngs=nnx.Rngs(seed)), nnx.Param))


def _requests(model: ModelConfig = MODEL) -> list[GenerationRequest]:
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=NEW, stop_token_ids=())
    return [
        GenerationRequest(
            f"r{i}", f"p{i}", 0, tuple(int(t) for t in rng.integers(0, model.vocab_size, PROMPT)),
            sampling,
        )
        for i in range(ROWS)
    ]  # fmt: skip


def _generate(model: ModelConfig, weight_dtype: str, params: dict, **engine) -> list:
    inference = dataclasses.replace(INFERENCE, weight_dtype=weight_dtype)
    served = Engine(model, inference, seed=0, **engine)
    served.load(0, params)
    return served.run(_requests(model))


def _behaviour(rollouts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rollouts as the trainer's batch lays them out (controller.assembly.rollout_rows)."""
    return rollout_rows(rollouts, PROMPT + NEW)


@functools.cache
def _recompute_fn(model: ModelConfig):
    abstract = nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0)))
    graphdef = nnx.split(abstract, nnx.Param)[0]
    return jax.jit(lambda p, t: recompute_logprobs(graphdef, p, t, micro_size=ROWS))


def _recompute(model: ModelConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    """The trainer's recompute of log π_old (unquantized weights), float32[rows, seq]."""
    return np.asarray(_recompute_fn(model)(params, tokens))


@pytest.fixture(scope="module")
def served():
    """Rollouts of one batch served unquantized, int8 and fp8 from the same weights, each with
    the trainer's recompute of its tokens from the unquantized weights."""
    params = _params(MODEL)
    out = {}
    for weight_dtype in ("", "int8", "fp8"):
        tokens, mask, behaviour = _behaviour(_generate(MODEL, weight_dtype, params))
        out[weight_dtype] = (_recompute(MODEL, params, tokens), behaviour, mask)
    return out


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8"])
def test_round_trip_error_is_bounded_per_output_channel(weight_dtype):
    """Channels 1e-3 to 10 apart in magnitude (and an all-zero one): each channel's error is
    bounded by its own scale (int8: half a step; fp8: 3 mantissa bits, or fp8's subnormal
    step), and its largest element maps to the dtype's largest value. A scale shared across
    channels would break the small channels' bound."""
    rng = np.random.default_rng(0)
    magnitudes = np.array([1e-3, 1e-1, 1.0, 10.0, 0.0], np.float32)
    w = rng.standard_normal((48, 5)).astype(np.float32) * magnitudes  # [in, out]
    q, scale = quantization.quantize(jnp.asarray(w), weight_dtype, in_axes=(0,))
    assert q.dtype == quantization.DTYPES[weight_dtype] and scale.shape == (1, 5)
    back = np.asarray(quantization.dequantize(q, scale, jnp.float32))
    scale = np.asarray(scale)
    err = np.abs(back - w)
    if weight_dtype == "int8":
        bound = scale / 2 * (1 + 1e-6)
    else:
        bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert (err <= bound).all(), (err / bound).max(axis=0)
    qmax = np.abs(np.asarray(q).astype(np.float32)).max(axis=0)
    np.testing.assert_array_equal(qmax[:4], quantization.QMAX[weight_dtype])
    assert qmax[4] == 0 and scale[0, 4] == 1.0 and (back[:, 4] == 0).all()


def test_the_scales_are_per_output_channel_of_every_projection():
    """The output projection has two input dimensions (heads, head_dim): its scale is per
    embedding channel; the others per output of their last dimensions."""

    def build() -> Transformer:
        model = Transformer(MODEL, rngs=nnx.Rngs(0))
        quantization.quantize_model(model, "int8")
        return model

    model = nnx.eval_shape(build)
    layer = model.layers[0]
    h, kv, d, e, m = MODEL.num_heads, MODEL.num_kv_heads, MODEL.head_dim, 32, 64
    scales = {
        ("attn", "wq"): (1, h, d), ("attn", "wk"): (1, kv, d), ("attn", "wv"): (1, kv, d),
        ("attn", "wo"): (1, 1, e),
        ("mlp", "w_gate"): (1, m), ("mlp", "w_up"): (1, m), ("mlp", "w_down"): (1, e),
    }  # fmt: skip
    for (module_name, name), shape in scales.items():
        module = getattr(layer, module_name)
        assert getattr(module, name).get_value().dtype == jnp.int8, name
        assert getattr(module, name + "_scale").get_value().shape == shape, name
    assert model.embed.get_value().dtype == jnp.float32  # embedding and lm_head unquantized
    assert model.lm_head.get_value().dtype == jnp.float32


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8"])
def test_quantized_behaviour_logprobs_stay_within_the_bound_of_the_unquantized(
    served, weight_dtype
):
    recomputed, behaviour, mask = served[weight_dtype]
    diff = np.abs(recomputed - behaviour)[mask]
    assert diff.size == ROWS * NEW
    assert diff.max() <= BOUND[weight_dtype], (diff.mean(), diff.max())
    assert diff.mean() > 1e-5  # quantized: not the unquantized weights' log-probs


def test_the_trainers_mismatch_metric_reports_int8_serving_and_not_plain_serving(served):
    """`mismatch_metrics` (the trainer's recomputed-vs-cached metric): ~0 for unquantized
    serving (float rounding of differently shaped computations), clearly above it for int8."""
    plain = {k: float(v) for k, v in mismatch_metrics(*served[""]).items()}
    int8 = {k: float(v) for k, v in mismatch_metrics(*served["int8"]).items()}
    mean = "mismatch/recomputed_vs_cached_mean"
    assert plain[mean] < 1e-6 and plain["mismatch/recomputed_vs_cached_p95"] < 2e-6, plain
    assert int8[mean] > 1e-4 and int8[mean] > 100 * plain[mean], int8


def test_default_weight_dtype_serves_the_published_weights_unchanged():
    """weight_dtype "" serves the published leaves bit for bit, laid out as the plain model's
    state (no scale leaves): the jitted steps are those of the model before quantization."""
    model = dataclasses.replace(MODEL, dtype="bfloat16", publish_dtype="bfloat16")
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params(model))
    engine = Engine(model, INFERENCE, seed=0)
    engine.load(0, params)
    plain = nnx.eval_shape(lambda: Transformer(model.served(), rngs=nnx.Rngs(0)))
    expected = jax.tree.leaves(nnx.state(plain))
    assert [(x.shape, x.dtype) for x in engine.abstract_params()] == [
        (x.shape, x.dtype) for x in expected
    ]
    served = engine.served_params()
    given = jax.tree.leaves(params)  # the same (sorted-key) order as the model state's
    assert len(served) == len(given)
    for out, x in zip(served, given, strict=True):
        np.testing.assert_array_equal(
            np.asarray(out).view(np.uint16), np.asarray(x).view(np.uint16)
        )


def _bytes(arrays) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in arrays)


def test_int8_and_fp8_hold_half_the_projection_bytes_of_bf16():
    """bf16-published weights: the projections take 1 byte a weight instead of 2 (plus a float32
    scale per output channel); the embedding, lm_head and norms stay bf16."""
    model = ModelConfig(
        vocab_size=64, hidden_size=64, intermediate_size=256, num_heads=4, head_dim=16,
        dtype="bfloat16", publish_dtype="bfloat16",
    )  # fmt: skip
    bf16 = Engine(model, INFERENCE, seed=0, allocate=False).abstract_params()
    projections = 2 * (64 * 16 * (2 * 4 + 2 * 2) + 3 * 64 * 256)
    for weight_dtype in ("int8", "fp8"):
        inference = dataclasses.replace(INFERENCE, weight_dtype=weight_dtype)
        quantized = Engine(model, inference, seed=0, allocate=False).abstract_params()
        stored = np.dtype(quantization.DTYPES[weight_dtype])
        assert _bytes(x for x in quantized if x.dtype == stored) == projections
        embeddings = 2 * (64 * 64) * 2  # embed, lm_head
        assert _bytes(x for x in bf16 if len(x.shape) > 1) - embeddings == 2 * projections
        ratio = _bytes(quantized) / _bytes(bf16)
        assert 0.5 < ratio < 0.56, ratio  # scales: 768 floats a layer; embeddings: bf16


def test_a_sharded_int8_engine_places_each_leaf_as_its_layout_says():
    """On a mesh (tensor=2) the quantized values and scales are made on their devices, in the
    shardings the jitted steps are compiled for, and generate as on one device."""
    params = _params(MODEL)
    mesh = build_mesh(MeshConfig(data=1, fsdp=1, tensor=2), devices=jax.devices()[:2])
    inference = dataclasses.replace(INFERENCE, weight_dtype="int8")
    engine = Engine(MODEL, inference, seed=0, mesh=mesh)
    engine.load(0, params)
    for leaf, layout in zip(engine.served_params(), engine.abstract_params(), strict=True):
        assert leaf.dtype == layout.dtype
        assert leaf.sharding.is_equivalent_to(layout.sharding, leaf.ndim)
    wq = next(x for x in engine.served_params() if x.shape == (32, 4, 8))
    assert wq.dtype == jnp.int8 and len(wq.sharding.device_set) == 2


LORA_MODEL = dataclasses.replace(MODEL, lora=LoraConfig(targets=LORA_TARGETS))  # every projection


def _lora_params(seed: int = 1) -> dict:
    """A LoRA model's params with trained-looking adapters (B nonzero)."""
    params = _params(LORA_MODEL)
    rng = np.random.default_rng(seed)

    def train(path, x):
        if str(path[-1].key).endswith("_lora_b"):
            return (0.2 * rng.standard_normal(x.shape)).astype(np.float32)
        return x

    return jax.tree_util.tree_map_with_path(train, params)


def test_lora_adapters_stay_unquantized_and_apply_on_an_int8_base():
    """LoRA on an int8 base: the adapters are served in float32 and added to the quantized
    base's product; the log-probs are within the int8 bound of the recompute with adapters
    and far from the base's alone."""
    params = _lora_params()
    rollouts = _generate(LORA_MODEL, "int8", params)
    tokens, mask, behaviour = _behaviour(rollouts)
    with_adapters = _recompute(LORA_MODEL, params, tokens)
    diff = np.abs(with_adapters - behaviour)[mask]
    assert diff.max() <= BOUND["int8"], (diff.mean(), diff.max())
    base_only = jax.tree_util.tree_map_with_path(
        lambda path, x: np.zeros_like(x) if str(path[-1].key).endswith("_lora_b") else x, params
    )
    without = np.abs(_recompute(LORA_MODEL, base_only, tokens) - behaviour)[mask]
    assert without.mean() > 10 * BOUND["int8"], without.mean()


def test_a_lora_base_is_quantized_once_across_versions():
    """A LoRA worker gives the engine the same base arrays with each version's adapters (the
    base is read once): the next version reuses the quantized base and takes the new
    adapters; a new base is quantized again."""
    inference = dataclasses.replace(INFERENCE, weight_dtype="int8")
    engine = Engine(LORA_MODEL, inference, seed=0, allocate=False)
    params = jax.tree.map(jnp.asarray, _lora_params(seed=1))
    engine.load(0, params)
    first = engine.served_params()
    adapters = jax.tree.map(jnp.asarray, _lora_params(seed=2))
    nxt = jax.tree_util.tree_map_with_path(
        lambda path, base, new: new if "_lora_" in str(path[-1].key) else base, params, adapters
    )
    engine.load(1, nxt)
    second = engine.served_params()
    int8 = [i for i, x in enumerate(first) if x.dtype == jnp.int8]
    assert len(int8) == 7 * MODEL.num_layers
    assert all(second[i] is first[i] for i in int8)
    changed = [i for i, x in enumerate(first) if not np.array_equal(x, second[i])]
    assert changed and all(first[i].dtype == jnp.float32 for i in changed)
    copied = jax.tree.map(lambda x: x + 0, nxt)  # new base arrays, same values
    engine.load(2, copied)
    third = engine.served_params()
    assert all(third[i] is not second[i] for i in int8)
    for i in int8:
        np.testing.assert_array_equal(third[i], second[i])
