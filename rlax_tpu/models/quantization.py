"""Weight-only quantization of the transformer's projections for serving
(`inference.weight_dtype`): int8 or float8_e4m3fn values with one float32 scale per output
channel (symmetric absmax), dequantized in the matmul.

A quantized weight is two leaves of the model state: `<w>` (int8 / fp8, the weight's shape and
logical axes) and `<w>_scale` (float32, the weight's shape with its input dimensions kept at
size 1: it broadcasts over them, per layer or stacked). The projections read `weight(module,
name, dtype)`: the plain weight cast to the compute dtype, or the dequantized one,
`round_dtype(q · scale)` computed in float32, which XLA:TPU fuses into the dot's operand
(XLA:CPU materialises it before the dot: there int8 saves memory, not time). LoRA
adapters (rlax_tpu.models.lora) are never quantized: they are added to the quantized base's
product as to the plain one's.

Quantized: the attention q/k/v/o and MLP gate/up/down projections of every decoder layer.
Not quantized: the embedding (a gather of a few rows per token: quantizing it saves memory
but no bandwidth) and lm_head (the logits the behaviour log-probs are read from, computed in
float32; an error there lands on every token's log-prob unattenuated, and the tied case
shares the table with the embedding), as the usual weight-only recipes keep them; norms,
biases and the value head are vectors.

Why not qwix (Google's JAX quantization library, compatible with the pinned jax/flax): its
PTQ provider intercepts the ops of one method of the top-level module and swaps each weight
for its quantized form when an intercepted op first runs, in the module it runs in. The
inference engine runs a model merged afresh from a flat list of placed leaves in every
jitted step (`inference.steps.StaticKey.model`), and lays out, shards and sizes those leaves
before any call (`inference.weights.ServedWeights`, `rlax-tpu compile`): the quantized
layout has to be known up front, as ordinary parameters with logical axes. What is needed
here — an absmax per output channel, two leaves, a dequantizing read — is small enough to
state in full.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from rlax_tpu.models import lora

WeightDtype = Literal["int8", "fp8"]
DTYPES: dict[str, jnp.dtype] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
# The largest value of each stored dtype the absmax maps to (symmetric: int8 uses ±127).
QMAX: dict[str, float] = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}
SCALE_SUFFIX = "_scale"

# The quantized weights of a decoder layer: (module attribute, weight attribute, number of
# leading input dimensions of the weight), the projections LoRA may adapt.
PROJECTIONS: tuple[tuple[str, str, int], ...] = tuple(lora.TARGET_WEIGHTS.values())


def is_projection(path: tuple) -> bool:
    """Whether a params-tree path (its key tuple) names a projection weight quantized for
    serving: `layers/<i>/attn/wq`, ..., not its adapters."""
    return len(path) >= 2 and (str(path[-2]), str(path[-1])) in {(m, w) for m, w, _ in PROJECTIONS}


def quantize(
    w: jax.Array, weight_dtype: WeightDtype, in_axes: tuple[int, ...]
) -> tuple[jax.Array, jax.Array]:
    """(values, scale) of `w` quantized per output channel: scale = max |w| over `in_axes`
    / QMAX (1 for an all-zero channel), values = w / scale rounded to `weight_dtype` (int8:
    to nearest, clipped to ±127; fp8: float8_e4m3fn's round to nearest even, |w / scale| ≤
    448 so never out of range). scale: float32, `w`'s shape with `in_axes` of size 1.

    The round trip's error per element is at most scale / 2 for int8 (half a step), and for
    fp8 2^-4 of the element's magnitude (3 mantissa bits) or, below fp8's normal range
    (|w / scale| < 2^-6), scale · 2^-10."""
    wf = w.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(wf), axis=in_axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / QMAX[weight_dtype], 1.0)
    scaled = wf / scale
    if weight_dtype == "int8":
        values = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:
        values = scaled.astype(DTYPES[weight_dtype])
    return values, scale


def dequantize(values: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """values · scale in float32, rounded once to `dtype` (the compute dtype)."""
    return (values.astype(jnp.float32) * scale).astype(dtype)


def weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """`module.<name>` in `dtype` for a matmul: dequantized when the module holds its scale
    (`<name>_scale`, a quantized served model), else the weight cast."""
    w = getattr(module, name).get_value()
    scale = getattr(module, name + SCALE_SUFFIX, None)
    if scale is None:
        return w.astype(dtype)
    return dequantize(w, scale.get_value(), dtype)


def _in_axes(logical_axes: tuple, in_ndim: int) -> tuple[int, ...]:
    """The input dimensions of a projection weight with `logical_axes`: its first `in_ndim`,
    after the leading "layers" axis of stacked (scanned) layers."""
    lead = 1 if logical_axes and logical_axes[0] == "layers" else 0
    return tuple(range(lead, lead + in_ndim))


def quantize_model(model: nnx.Module, weight_dtype: WeightDtype) -> None:
    """In place: every decoder layer's projection weights (`PROJECTIONS`) of a Transformer
    replaced by their quantized values, each with its `<name>_scale` next to it (nnx.Param,
    logical axes the weight's with None on its input dimensions, replicated there). Run
    under `nnx.eval_shape` it gives the served layout without computing anything."""
    layers = [model.layers] if model.scan_layers else list(model.layers)
    for layer in layers:
        for module_name, weight_name, in_ndim in PROJECTIONS:
            module = getattr(layer, module_name)
            param = getattr(module, weight_name)
            axes = tuple(param.logical_axes)
            reduce = _in_axes(axes, in_ndim)
            values, scale = quantize(param.get_value(), weight_dtype, reduce)
            scale_axes = tuple(None if i in reduce else a for i, a in enumerate(axes))
            setattr(module, weight_name, nnx.Param(values, logical_axes=axes))
            setattr(
                module,
                weight_name + SCALE_SUFFIX,
                nnx.Param(scale, logical_axes=scale_axes),
            )
